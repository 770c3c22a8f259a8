//! The request headers that say how to decode a body. The filter reads every POST body as
//! UTF-8 JSON; a body declared in another charset, or compressed, may be decoded otherwise
//! by the upstream (in UTF-7, `+AG0-ethod` is `method`), so it is refused, never passed.

/// Why the body's headers are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// More than one `Content-Type`: which one the upstream uses is its choice.
    ContentTypeRepeated,
    /// A `charset` parameter other than one `utf-8`.
    Charset,
    /// A `Content-Encoding` other than `identity`.
    ContentEncoding,
}

impl Refusal {
    /// The JSON-RPC error message.
    pub fn message(self) -> &'static str {
        match self {
            Refusal::ContentTypeRepeated => {
                "Invalid Request: Content-Type is sent more than once"
            }
            Refusal::Charset => {
                "Invalid Request: the body's charset must be utf-8 (or not declared)"
            }
            Refusal::ContentEncoding => {
                "Invalid Request: Content-Encoding must be identity (or absent); the body is read as sent"
            }
        }
    }
}

/// Checks every `Content-Type` and `Content-Encoding` value of a request whose body will
/// be read.
pub fn check(content_type: &[Vec<u8>], content_encoding: &[Vec<u8>]) -> Result<(), Refusal> {
    match content_type {
        [] => {}
        [one] => charset_is_utf8(one)?,
        _ => return Err(Refusal::ContentTypeRepeated),
    }
    for value in content_encoding {
        let value = std::str::from_utf8(value).map_err(|_| Refusal::ContentEncoding)?;
        // `identity, gzip` is gzip: every coding listed must be identity.
        if !value
            .split(',')
            .all(|coding| coding.trim().eq_ignore_ascii_case("identity"))
        {
            return Err(Refusal::ContentEncoding);
        }
    }
    Ok(())
}

fn charset_is_utf8(content_type: &[u8]) -> Result<(), Refusal> {
    let value = std::str::from_utf8(content_type).map_err(|_| Refusal::Charset)?;
    let mut seen = false;
    // Splitting on every `;`, quoted or not, can only reveal more parameters than a
    // quote-aware parser sees: a charset hidden in a quoted value is still checked.
    for param in value.split(';').skip(1) {
        let (name, val) = param.split_once('=').unwrap_or((param, ""));
        let name = name.trim().to_ascii_lowercase();
        // `charset*` (RFC 2231) and look-alikes count as a charset too.
        if !name.starts_with("charset") {
            continue;
        }
        let val = val.trim();
        let val = val
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or(val);
        if seen || name != "charset" || !val.eq_ignore_ascii_case("utf-8") {
            return Err(Refusal::Charset);
        }
        seen = true;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ct(v: &str) -> Result<(), Refusal> {
        check(&[v.as_bytes().to_vec()], &[])
    }

    fn ce(values: &[&str]) -> Result<(), Refusal> {
        let values: Vec<Vec<u8>> = values.iter().map(|v| v.as_bytes().to_vec()).collect();
        check(&[], &values)
    }

    #[test]
    fn utf8_or_no_charset_is_read() {
        assert_eq!(check(&[], &[]), Ok(()));
        for v in [
            "application/json",
            "application/json; charset=utf-8",
            "application/json;charset=UTF-8",
            "application/json; charset=\"Utf-8\"",
            "application/json ; Charset = utf-8 ; q=1",
            "text/plain",
        ] {
            assert_eq!(ct(v), Ok(()), "{v}");
        }
    }

    #[test]
    fn any_other_charset_is_refused() {
        for v in [
            "application/json; charset=utf-7",
            "application/json; charset=utf-16",
            "application/json; charset=ISO-8859-1",
            "application/json; charset=utf8",
            "application/json; charset=",
            "application/json; charset",
            "application/json; charset=utf-8; charset=utf-7",
            "application/json; charset=utf-8; charset=utf-8",
            "application/json; charset*=utf-8''",
            "application/json; x=\"a;charset=utf-7\"",
        ] {
            assert_eq!(ct(v), Err(Refusal::Charset), "{v}");
        }
        assert_eq!(
            check(&[vec![0xff, b';'], b"x".to_vec()], &[]),
            Err(Refusal::ContentTypeRepeated)
        );
        assert_eq!(
            check(&[b"a/b; charset=\xff".to_vec()], &[]),
            Err(Refusal::Charset)
        );
    }

    #[test]
    fn only_identity_content_encoding_is_read() {
        assert_eq!(ce(&["identity"]), Ok(()));
        assert_eq!(ce(&["IDENTITY", " identity , identity "]), Ok(()));
        for values in [
            &["gzip"][..],
            &["br"],
            &["deflate"],
            &["identity, gzip"],
            &["identity", "gzip"],
            &[""],
            &["identity,"],
        ] {
            assert_eq!(ce(values), Err(Refusal::ContentEncoding), "{values:?}");
        }
        assert_eq!(
            check(&[], &[b"identit\xff".to_vec()]),
            Err(Refusal::ContentEncoding)
        );
    }
}
