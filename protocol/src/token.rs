//! The shape of a permit token, which both sides read: the ledger to find the permit it
//! names, the filter (`request_hold: body`) to derive the upstream idempotency key before the
//! ledger has answered (the ledger then confirms the permit, or the call is not sent).
//!
//! A token is `atmp_<permit id>_<64 hex chars>`; the permit id is `pmt_<24 hex chars>`.
//! The random parts are hex, so the last `_` separates id and secret unambiguously.

pub const TOKEN_PREFIX: &str = "atmp_";
pub const PERMIT_ID_PREFIX: &str = "pmt_";

/// The permit id a token spells, if the token is well formed. Only the ledger, which holds
/// the token's hash, can say whether the token is genuine: until then the id is a claim.
pub fn permit_id_of(token: &str) -> Option<&str> {
    let rest = token.strip_prefix(TOKEN_PREFIX)?;
    let (id, secret) = rest.rsplit_once('_')?;
    if id.is_empty()
        || secret.len() < 32
        || !secret.bytes().all(|b| b.is_ascii_hexdigit())
        || !id.starts_with(PERMIT_ID_PREFIX)
    {
        return None;
    }
    Some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_spells_its_permit_id() {
        let token = format!("atmp_pmt_0123456789abcdef01234567_{}", "ab".repeat(32));
        assert_eq!(permit_id_of(&token), Some("pmt_0123456789abcdef01234567"));
    }

    #[test]
    fn malformed_tokens_have_no_id() {
        for t in [
            "",
            "atmp_",
            "atmp_pmt_abc",
            "xx_pmt_abc_00000000000000000000000000000000",
            "atmp_pmt_abc_zz000000000000000000000000000000",
            "atmp__00000000000000000000000000000000",
            "atmp_xyz_00000000000000000000000000000000",
        ] {
            assert_eq!(permit_id_of(t), None, "{t}");
        }
    }
}
