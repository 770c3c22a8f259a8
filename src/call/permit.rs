//! The permit token of a governed call, read from the configured permit header.

use std::fmt;

/// Why the permit header gives no token; carries the header's name for the denial text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PermitHeaderError {
    Missing(String),
    NotAToken(String),
    Repeated(String),
}

impl fmt::Display for PermitHeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PermitHeaderError::Missing(h) => {
                write!(f, "no permit: send the permit token in the `{h}` header")
            }
            PermitHeaderError::NotAToken(h) => {
                write!(f, "the `{h}` header is empty or not a token")
            }
            PermitHeaderError::Repeated(h) => write!(f, "the `{h}` header was sent more than once"),
        }
    }
}

impl std::error::Error for PermitHeaderError {}

/// The token of the one `header` value sent (surrounding whitespace trimmed), which must
/// be visible ASCII.
pub fn token(values: &[Vec<u8>], header: &str) -> Result<String, PermitHeaderError> {
    match values {
        [] => Err(PermitHeaderError::Missing(header.to_string())),
        [one] => match std::str::from_utf8(one).map(str::trim) {
            Ok(t) if !t.is_empty() && t.bytes().all(|b| (0x21..=0x7e).contains(&b)) => {
                Ok(t.to_string())
            }
            _ => Err(PermitHeaderError::NotAToken(header.to_string())),
        },
        _ => Err(PermitHeaderError::Repeated(header.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_visible_ascii_value_is_the_token() {
        let h = "atmost-permit";
        assert_eq!(token(&[b" tok-1 ".to_vec()], h), Ok("tok-1".to_string()));
        assert_eq!(token(&[], h), Err(PermitHeaderError::Missing(h.into())));
        assert_eq!(
            token(&[b"a b".to_vec()], h),
            Err(PermitHeaderError::NotAToken(h.into()))
        );
        assert_eq!(
            token(&[b"".to_vec()], h),
            Err(PermitHeaderError::NotAToken(h.into()))
        );
        assert_eq!(
            token(&[b"a".to_vec(), b"b".to_vec()], h),
            Err(PermitHeaderError::Repeated(h.into()))
        );
        assert_eq!(
            PermitHeaderError::Repeated(h.into()).to_string(),
            "the `atmost-permit` header was sent more than once"
        );
    }
}
