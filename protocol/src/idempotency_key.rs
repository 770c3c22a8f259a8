//! The one rule for an idempotency key, which both sides apply: the filter to the key an agent
//! sent (its header or `params._meta`), the ledger to the key and the forwarded value a caller
//! of `/v1/authorize` states. A key either side accepts, the other accepts too.

/// Longest key, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

/// Why a key is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyFault {
    Empty,
    TooLong,
    /// A byte outside printable ASCII (0x20-0x7E): control characters would end up in logs
    /// and headers, and other bytes are read differently by different servers.
    NotPrintableAscii,
}

impl KeyFault {
    /// What is wrong, completing "the idempotency key …".
    pub fn describe(self) -> String {
        match self {
            KeyFault::Empty => "is empty".into(),
            KeyFault::TooLong => format!("is longer than {MAX_KEY_BYTES} bytes"),
            KeyFault::NotPrintableAscii => "must be printable ASCII (0x20-0x7E)".into(),
        }
    }
}

/// A key that passed the rule: only [`IdempotencyKey::parse`] makes one, so a function taking
/// one needs no check of its own.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The key, if it is 1 to [`MAX_KEY_BYTES`] bytes of printable ASCII.
    pub fn parse(key: &str) -> Result<IdempotencyKey, KeyFault> {
        check_key(key).map(|()| IdempotencyKey(key.to_owned()))
    }

    /// The same rule as [`IdempotencyKey::parse`], for a caller that only needs to know
    /// (the ledger's decision, on every call) and so makes no copy.
    pub fn check(key: &str) -> Result<(), KeyFault> {
        check_key(key)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

/// Checks a key against the rule: 1 to [`MAX_KEY_BYTES`] bytes of printable ASCII.
fn check_key(key: &str) -> Result<(), KeyFault> {
    if key.is_empty() {
        Err(KeyFault::Empty)
    } else if key.len() > MAX_KEY_BYTES {
        Err(KeyFault::TooLong)
    } else if !key.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        Err(KeyFault::NotPrintableAscii)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_one_to_255_bytes_of_printable_ascii() {
        assert_eq!(check_key("k"), Ok(()));
        assert_eq!(check_key(" ~"), Ok(()));
        assert_eq!(check_key(&"k".repeat(MAX_KEY_BYTES)), Ok(()));
        assert_eq!(check_key(""), Err(KeyFault::Empty));
        assert_eq!(
            check_key(&"k".repeat(MAX_KEY_BYTES + 1)),
            Err(KeyFault::TooLong)
        );
        for bad in ["a\nb", "a\tb", "a\u{7f}b", "clé"] {
            assert_eq!(check_key(bad), Err(KeyFault::NotPrintableAscii), "{bad:?}");
        }
        assert_eq!(
            IdempotencyKey::parse("k").map(IdempotencyKey::into_string),
            Ok("k".into())
        );
        assert_eq!(IdempotencyKey::parse(""), Err(KeyFault::Empty));
    }
}
