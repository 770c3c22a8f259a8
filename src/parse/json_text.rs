//! Reading well-formed JSON text in place: where the members of an object and the elements
//! of an array sit, as byte offsets. The filter edits a few members of a message this way
//! (the idempotency key of a request, the permit's figures in a response) and forwards
//! every other byte as it came, rather than re-serialising the message.
//!
//! Every function expects text that already parsed as JSON; on anything else it answers
//! `None` rather than guess.

/// Where one member of an object sits, as byte offsets into the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// First byte of the member's key string (its opening quote).
    pub key_start: usize,
    /// First byte of its value.
    pub value_start: usize,
    /// One past the last byte of its value.
    pub value_end: usize,
}

impl Member {
    /// Whether the member's key spells `name`.
    pub fn is(&self, text: &[u8], name: &str) -> bool {
        key_is(self.key(text), name) == Some(true)
    }

    /// The member's key string, quotes included.
    fn key<'a>(&self, text: &'a [u8]) -> &'a [u8] {
        let key = text
            .get(self.key_start..self.value_start)
            .unwrap_or_default();
        // The key string ends at its closing quote, before the colon.
        let end = key.iter().rposition(|&b| b == b'"').map_or(0, |i| i + 1);
        &key[..end]
    }

    /// The first byte of the value.
    pub fn value_opens(&self, text: &[u8]) -> Option<u8> {
        text.get(self.value_start).copied()
    }
}

/// The members of the object that starts at `at` (leading white space skipped), in order.
/// `None` when no object starts there.
pub fn members(text: &[u8], at: usize) -> Option<Vec<Member>> {
    let mut out = Vec::new();
    each_member(text, at, |m| out.push(m))?;
    Some(out)
}

/// Calls `f` with each member of the object that starts at `at`, in order, without
/// collecting them. `None` when no object starts there (or the text ends inside it).
fn each_member(text: &[u8], at: usize, mut f: impl FnMut(Member)) -> Option<()> {
    let mut s = Scanner::enter(text, at, b'{')?;
    loop {
        s.ws();
        match s.peek()? {
            b'}' => return Some(()),
            b',' => {
                s.i += 1;
                continue;
            }
            b'"' => {}
            _ => return None,
        }
        let key_start = s.i;
        s.skip_string()?;
        s.ws();
        if s.peek()? != b':' {
            return None;
        }
        s.i += 1;
        s.ws();
        let value_start = s.i;
        s.skip_value()?;
        f(Member {
            key_start,
            value_start,
            value_end: s.i,
        });
    }
}

/// The last member named `name` of the object at `at` (the one a JSON parser that keeps the
/// last of repeated keys reads).
pub fn member(text: &[u8], at: usize, name: &str) -> Option<Member> {
    let [found] = last_members(text, at, [name])?;
    found
}

/// The last member of each of `names` in the object at `at`, as [`member`] finds them, in
/// one walk over the object. `None` when no object starts there.
pub fn last_members<const N: usize>(
    text: &[u8],
    at: usize,
    names: [&str; N],
) -> Option<[Option<Member>; N]> {
    let mut found = [None; N];
    each_member(text, at, |m| {
        let key = m.key(text);
        for (slot, name) in found.iter_mut().zip(names) {
            if key_is(key, name) == Some(true) {
                *slot = Some(m);
            }
        }
    })?;
    Some(found)
}

/// Whether the object that starts at `at` has no member; `None` when no object starts there.
/// Only its first token is read: the text already parsed as JSON.
pub fn is_empty_object(text: &[u8], at: usize) -> Option<bool> {
    let mut s = Scanner::enter(text, at, b'{')?;
    s.ws();
    Some(s.peek()? == b'}')
}

/// `s` as a JSON string, quotes included, escaped as serde_json and RFC 8785 §3.2.2.2 escape
/// it: `"` and `\\`, the control characters as `\b \t \n \f \r` or `\u00xx` (lowercase hex),
/// everything else as it is.
pub fn push_string(out: &mut String, s: &str) {
    out.push('"');
    let mut plain_from = 0;
    for (i, byte) in s.bytes().enumerate() {
        let escape = match byte {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\x08' => "\\b",
            b'\t' => "\\t",
            b'\n' => "\\n",
            b'\x0c' => "\\f",
            b'\r' => "\\r",
            0..=0x1f => "",
            _ => continue,
        };
        // `i` is at an ASCII byte, so both ends are character boundaries.
        out.push_str(s.get(plain_from..i).unwrap_or_default());
        if escape.is_empty() {
            const DIGITS: &[u8; 16] = b"0123456789abcdef";
            out.push_str("\\u00");
            out.push(char::from(DIGITS[usize::from(byte >> 4)]));
            out.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
        } else {
            out.push_str(escape);
        }
        plain_from = i + 1;
    }
    out.push_str(s.get(plain_from..).unwrap_or_default());
    out.push('"');
}

/// `s` as a JSON string (see [`push_string`]).
pub fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    push_string(&mut out, s);
    out
}

/// The elements of the array that starts at `at`, as `(start, end)` byte ranges. `None`
/// when no array starts there.
pub fn elements(text: &[u8], at: usize) -> Option<Vec<(usize, usize)>> {
    let mut s = Scanner::enter(text, at, b'[')?;
    let mut out = Vec::new();
    loop {
        s.ws();
        match s.peek()? {
            b']' => return Some(out),
            b',' => s.i += 1,
            _ => {
                let start = s.i;
                s.skip_value()?;
                out.push((start, s.i));
            }
        }
    }
}

/// Where the first value of the text starts (after leading white space).
pub fn first_value(text: &[u8]) -> usize {
    let mut s = Scanner { b: text, i: 0 };
    s.ws();
    s.i
}

/// Whether the JSON string `quoted` (quotes included) spells `name`. Most keys hold no
/// escape and are compared as bytes; an escaped one is decoded first.
pub fn key_is(quoted: &[u8], name: &str) -> Option<bool> {
    let inner = quoted.get(1..quoted.len().checked_sub(1)?)?;
    if !inner.contains(&b'\\') {
        return Some(inner == name.as_bytes());
    }
    let key: String = serde_json::from_slice(quoted).ok()?;
    Some(key == name)
}

/// A forward-only walk over well-formed JSON text.
struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    /// Just inside the object or array (`open` is its first byte) that starts at `at`.
    fn enter(b: &'a [u8], at: usize, open: u8) -> Option<Scanner<'a>> {
        let mut s = Scanner { b, i: at };
        s.ws();
        if s.peek()? != open {
            return None;
        }
        s.i += 1;
        Some(s)
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    /// Skips the string that starts at the current byte (its opening quote).
    fn skip_string(&mut self) -> Option<()> {
        self.i += 1; // opening quote
        loop {
            let c = *self.b.get(self.i)?;
            self.i += 1;
            match c {
                b'\\' => self.i += 1,
                b'"' => return Some(()),
                _ => {}
            }
        }
    }

    /// Skips one value without recursion: nesting depth is only counted.
    fn skip_value(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.skip_string(),
            b'{' | b'[' => {
                // Inside an object or array only strings and brackets matter.
                let mut depth = 0usize;
                loop {
                    match *self.b.get(self.i)? {
                        b'"' => self.skip_string()?,
                        b'{' | b'[' => {
                            depth += 1;
                            self.i += 1;
                        }
                        b'}' | b']' => {
                            depth = depth.checked_sub(1)?;
                            self.i += 1;
                            if depth == 0 {
                                return Some(());
                            }
                        }
                        _ => self.i += 1,
                    }
                }
            }
            _ => {
                // A number or a literal: it ends where a delimiter or white space begins.
                loop {
                    match self.peek()? {
                        b',' | b'}' | b']' => return Some(()),
                        c if c.is_ascii_whitespace() => return Some(()),
                        _ => self.i += 1,
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value<'a>(text: &'a str, m: &Member) -> &'a str {
        &text[m.value_start..m.value_end]
    }

    #[test]
    fn members_and_elements_as_they_sit() {
        let text = r#" { "a" : [1, {"b":"}"}] ,"c":"x\"y", "d":{} , "e": -1.50e3 } "#;
        let ms = members(text.as_bytes(), 0).unwrap_or_default();
        let values: Vec<&str> = ms.iter().map(|m| value(text, m)).collect();
        assert_eq!(values, [r#"[1, {"b":"}"}]"#, r#""x\"y""#, "{}", "-1.50e3"]);
        assert!(ms[1].is(text.as_bytes(), "c") && !ms[1].is(text.as_bytes(), "a"));
        let arr = elements(text.as_bytes(), ms[0].value_start).unwrap_or_default();
        let items: Vec<&str> = arr.iter().map(|&(a, b)| &text[a..b]).collect();
        assert_eq!(items, ["1", r#"{"b":"}"}"#]);
        assert_eq!(members(b"{}", 0), Some(Vec::new()));
        assert_eq!(elements(b" [ ] ", 0), Some(Vec::new()));
        assert_eq!(members(b"[1]", 0), None);
        assert_eq!(elements(b"{}", 0), None);
        assert_eq!(first_value(b" \n {}"), 3);
    }

    #[test]
    fn member_takes_the_last_of_repeated_keys_and_decodes_escapes() {
        let text = br#"{"k":1,"\u006b":2,"K":3}"#;
        let m = member(text, 0, "k").map(|m| &text[m.value_start..m.value_end]);
        assert_eq!(m, Some(&b"2"[..]));
        assert_eq!(member(text, 0, "x"), None);
    }

    #[test]
    fn empty_objects_are_told_by_their_first_token() {
        assert_eq!(is_empty_object(b" { \n } ", 0), Some(true));
        assert_eq!(is_empty_object(br#"{"a":{}}"#, 0), Some(false));
        assert_eq!(is_empty_object(br#"{"a":{}}"#, 5), Some(true));
        assert_eq!(is_empty_object(b"[]", 0), None);
    }

    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        for s in [
            "",
            "plain",
            "q\"b\\s/",
            "\u{0}\u{1}\u{8}\t\n\u{b}\u{c}\r\u{1f} \u{7f}",
            "\u{e9}\u{2028}\u{fb33}\u{1f600}",
        ] {
            assert_eq!(
                quoted(s),
                serde_json::to_string(s).unwrap_or_default(),
                "{s:?}"
            );
        }
    }

    #[test]
    fn last_members_finds_each_name_as_member_does() {
        let text = br#"{"a":1,"b":{"a":9},"\u0061":2,"c":[3]}"#;
        let value = |m: Option<Member>| m.map(|m| &text[m.value_start..m.value_end]);
        let [a, c, x] = last_members(text, 0, ["a", "c", "x"]).unwrap_or_default();
        assert_eq!(
            (value(a), value(c), value(x)),
            (Some(&b"2"[..]), Some(&b"[3]"[..]), None)
        );
        for name in ["a", "b", "c", "x"] {
            assert_eq!(last_members(text, 0, [name]), Some([member(text, 0, name)]));
        }
        assert_eq!(last_members(b"[1]", 0, ["a"]), None);
    }

    #[test]
    fn keys_compare_as_decoded_text() {
        assert_eq!(key_is(br#""_meta""#, "_meta"), Some(true));
        assert_eq!(key_is(br#""\u005fmeta""#, "_meta"), Some(true));
        assert_eq!(key_is(br#""_met""#, "_meta"), Some(false));
        assert_eq!(key_is(br#""_meta\n""#, "_meta"), Some(false));
        assert_eq!(key_is(br#""""#, ""), Some(true));
        assert_eq!(key_is(b"\"", "_meta"), None);
    }
}
