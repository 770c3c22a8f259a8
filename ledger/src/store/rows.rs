//! The permit and attempt columns every store selects, and their one mapping to the model.
//!
//! Each store's driver reads the columns of [`PERMIT_COLS`] into a [`PermitRow`] and those of
//! [`ATTEMPT_COLS`] into an [`AttemptRow`] (a getter per column, nothing else); what the values
//! mean (the policy's JSON, the state's name, the resolution's three columns, the round's
//! range) is checked here once, so the stores cannot read a permit or an attempt differently.
//! The permit's columns and the attempt's are one table each
//! ([`record!`](crate::store::record)): the row type, the select list and both stores'
//! readers come from it, and for the attempt both stores' write statements too; both stores
//! write an attempt from the [`AttemptRow`] made here.

use crate::credentials::{CredentialForm, CredentialUse, StoredCredential};
use crate::error::LedgerError;
use crate::model::{Approval, Attempt, KeyCarriers, Permit, Resolution, ResolutionSource};
use crate::store::record::record;

record! {
    /// One permit row's column values as the driver read them (by name: queries may append
    /// their own columns), not yet checked. A permit is written by statements of its own
    /// (they also write its retention, a column only queries read); this table gives its reads.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct PermitRow, columns PERMIT_COLS for "", table PERMIT_TABLE {
        id: String, Insert;
        token_hash: String, Insert;
        label: String, Insert;
        created_at: i64, Insert;
        expires_at: i64, Insert;
        revoked_at: Option<i64>, Update;
        /// The policy as JSON text.
        policy: String, Insert;
    }
}

impl TryFrom<PermitRow> for Permit {
    type Error = LedgerError;

    fn try_from(row: PermitRow) -> Result<Self, Self::Error> {
        Ok(Permit {
            id: row.id,
            token_hash: row.token_hash,
            label: row.label,
            created_at_ms: row.created_at,
            expires_at_ms: row.expires_at,
            revoked_at_ms: row.revoked_at,
            policy: serde_json::from_str(&row.policy)?,
        })
    }
}

/// The `signing_keys` columns, in the order a store reads them into a
/// [`StoredSigningKey`](crate::keys::StoredSigningKey).
pub const SIGNING_KEY_COLS: &str = "kid, public_key, private_pkcs8, created_at, retired_at";

/// The same columns with NULL for the private key: every read but the active key's, so the
/// private half leaves the store only to sign.
/// The order keys are listed in: the active key first, then the retired ones, last retired
/// first; ties (keys made in one millisecond) broken by kid.
pub const KEY_ORDER: &str = "retired_at IS NOT NULL, retired_at DESC, created_at DESC, kid";
pub const SIGNING_KEY_PUBLIC_COLS: &str =
    "kid, public_key, CAST(NULL AS TEXT), created_at, retired_at";

/// The `credentials` columns, in the order [`CredentialRow`] reads them.
pub const CREDENTIAL_COLS: &str = "name, version, header, form, route, sealed, created_at";

/// The same columns with NULL for the sealed secret: every read but a dispatch's, so the
/// secret leaves the store only to be sent.
pub const CREDENTIAL_PUBLIC_COLS: &str =
    "name, version, header, form, route, CAST(NULL AS TEXT), created_at";

/// One `credentials` row's column values as the driver read them, in [`CREDENTIAL_COLS`]
/// order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialRow {
    pub name: String,
    pub version: i64,
    pub header: String,
    pub form: String,
    pub route: String,
    pub sealed: Option<String>,
    pub created_at: i64,
}

impl TryFrom<CredentialRow> for StoredCredential {
    type Error = LedgerError;

    fn try_from(row: CredentialRow) -> Result<Self, Self::Error> {
        Ok(StoredCredential {
            version: u32::try_from(row.version).map_err(|_| {
                LedgerError::Corrupt(format!("credential version {} out of range", row.version))
            })?,
            form: CredentialForm::from_wire(&row.form)
                .ok_or_else(|| LedgerError::Corrupt(format!("credential form {:?}", row.form)))?,
            name: row.name,
            header: row.header,
            routes: crate::credentials::routes_of_column(&row.route),
            sealed: row.sealed,
            created_at_ms: row.created_at,
        })
    }
}

/// A count or amount as both stores keep it (SQL's signed 64-bit integer); larger is refused.
pub fn to_i64(n: u64) -> Result<i64, LedgerError> {
    i64::try_from(n).map_err(|_| LedgerError::Invalid(format!("{n} is too large to store")))
}

/// A stored count or amount read back; a negative one (never written) reads as 0.
pub fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

record! {
    /// One attempt row's column values as the driver read them (or as they are written), not
    /// yet checked. This table is the attempt's one list of columns: a new one is a line here
    /// (with its conversions below, and a migration of each store).
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct AttemptRow, columns ATTEMPT_COLS for "a.", table ATTEMPT_TABLE {
        id: String, Insert;
        permit_id: String, Insert;
        tool: String, Insert;
        key_hash: Option<String>, Insert;
        fingerprint: String, Insert;
        cost: i64, Insert;
        state: String, Both;
        created_at: i64, Insert;
        updated_at: i64, Both;
        lease_expires_at: i64, Both;
        finished_at: Option<i64>, Both;
        receipt: Option<String>, Both;
        reason: Option<String>, Both;
        replay_count: i64, Both;
        pruned_at: Option<i64>, Both;
        // The resolution: its three columns written together, its source and evidence
        // with them (see the conversion below).
        resolved_executed: Option<bool>, Update;
        resolved_by: Option<String>, Update;
        resolved_at: Option<i64>, Update;
        resolution_note: Option<String>, Update;
        round: i64 as i32, Both;
        capability_hash: Option<String>, Both;
        resolution_source: Option<String>, Update;
        provider_answer: Option<String>, Update;
        forwarded_key: Option<String>, Both;
        arguments: Option<String>, Both;
        /// [`KeyCarriers::to_list`]; `NULL` (written before version 6, or empty) is none.
        forwarded_key_carriers: Option<String>, Both;
        /// `NULL` before version 11, and for rounds dispatched without a signature.
        dispatch_body_sha256: Option<String>, Both;
        /// [`CredentialUse::to_column`]; `NULL` (none, or written before version 11) is none.
        /// Written again when an approved attempt is dispatched (it carries one from then).
        credential: Option<String>, Both;
        /// The [`Approval`] as JSON; `NULL` (none, or written before version 12) is none.
        approval: Option<String>, Both;
    }
}

/// How both stores keep an attempt's [`KeyCarriers`]: their names joined by `,`, or `NULL`
/// for none.
pub fn carriers_column(carriers: KeyCarriers) -> Option<String> {
    (!carriers.is_empty()).then(|| carriers.to_list())
}

/// A counter or count column as the model's unsigned number; the stores never write a
/// negative one, and one read back counts as none.
fn unsigned(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

impl AttemptRow {
    /// The columns an attempt is written as: the inverse of reading it back. A count too
    /// large to store is refused here, before anything is sent.
    pub fn of(a: &Attempt) -> Result<AttemptRow, LedgerError> {
        let r = a.resolution.as_ref();
        Ok(AttemptRow {
            id: a.id.clone(),
            permit_id: a.permit_id.clone(),
            tool: a.tool.clone(),
            key_hash: a.key_hash.clone(),
            fingerprint: a.fingerprint.clone(),
            cost: to_i64(a.cost)?,
            state: a.state.as_str().to_string(),
            created_at: a.created_at_ms,
            updated_at: a.updated_at_ms,
            lease_expires_at: a.lease_expires_at_ms,
            finished_at: a.finished_at_ms,
            receipt: a.receipt.clone(),
            reason: a.reason.clone(),
            replay_count: to_i64(a.replay_count)?,
            pruned_at: a.pruned_at_ms,
            resolved_executed: r.map(|r| r.executed),
            resolved_by: r.map(|r| r.by.clone()),
            resolved_at: r.map(|r| r.at_ms),
            resolution_note: r.and_then(|r| r.note.clone()),
            round: i64::from(a.round),
            capability_hash: a.capability_hash.clone(),
            resolution_source: r.map(|r| r.source.as_str().to_string()),
            provider_answer: r.and_then(|r| r.source.provider_answer().map(str::to_string)),
            forwarded_key: a.forwarded_key.clone(),
            arguments: a.arguments.clone(),
            forwarded_key_carriers: carriers_column(a.forwarded_key_carriers),
            dispatch_body_sha256: a.dispatch_body_sha256.clone(),
            credential: a.credential.as_ref().map(CredentialUse::to_column),
            approval: a.approval.as_ref().map(serde_json::to_string).transpose()?,
        })
    }
}

impl TryFrom<AttemptRow> for Attempt {
    type Error = LedgerError;

    fn try_from(row: AttemptRow) -> Result<Self, Self::Error> {
        // A resolution is stored in three columns written together; a row with any of them
        // missing has none. Its source (and the reconciler's evidence) came with version 5:
        // a resolution written before has none and was a person's.
        let resolution = match (row.resolved_executed, row.resolved_by, row.resolved_at) {
            (Some(executed), Some(by), Some(at_ms)) => Some(Resolution {
                executed,
                by,
                at_ms,
                note: row.resolution_note,
                source: ResolutionSource::from_stored(
                    row.resolution_source.as_deref(),
                    row.provider_answer,
                )
                .map_err(LedgerError::Corrupt)?,
            }),
            _ => None,
        };
        Ok(Attempt {
            id: row.id,
            permit_id: row.permit_id,
            tool: row.tool,
            key_hash: row.key_hash,
            fingerprint: row.fingerprint,
            cost: unsigned(row.cost),
            state: row.state.parse().map_err(LedgerError::Corrupt)?,
            created_at_ms: row.created_at,
            updated_at_ms: row.updated_at,
            lease_expires_at_ms: row.lease_expires_at,
            finished_at_ms: row.finished_at,
            receipt: row.receipt,
            reason: row.reason,
            replay_count: unsigned(row.replay_count),
            pruned_at_ms: row.pruned_at,
            resolution,
            round: u32::try_from(row.round).map_err(|_| {
                LedgerError::Corrupt(format!("attempt round {} out of range", row.round))
            })?,
            capability_hash: row.capability_hash,
            forwarded_key: row.forwarded_key,
            forwarded_key_carriers: KeyCarriers::from_list(
                row.forwarded_key_carriers.as_deref().unwrap_or_default(),
            )
            .map_err(LedgerError::Corrupt)?,
            arguments: row.arguments,
            dispatch_body_sha256: row.dispatch_body_sha256,
            credential: row
                .credential
                .as_deref()
                .map(CredentialUse::from_column)
                .transpose()?,
            approval: row
                .approval
                .as_deref()
                .map(serde_json::from_str::<Approval>)
                .transpose()
                .map_err(|e| LedgerError::Corrupt(format!("attempt approval: {e}")))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::AttemptState;

    fn row() -> AttemptRow {
        AttemptRow {
            id: "a1".into(),
            permit_id: "p1".into(),
            tool: "charge".into(),
            key_hash: Some("kh".into()),
            fingerprint: "fp".into(),
            cost: 5,
            state: "completed".into(),
            created_at: 1,
            updated_at: 2,
            lease_expires_at: 3,
            finished_at: Some(4),
            receipt: Some("r".into()),
            reason: None,
            replay_count: 2,
            pruned_at: None,
            resolved_executed: None,
            resolved_by: None,
            resolved_at: None,
            resolution_note: None,
            round: 2,
            capability_hash: Some("ch".into()),
            resolution_source: None,
            provider_answer: None,
            forwarded_key: Some("fk".into()),
            arguments: Some(r#"{"amount":5}"#.into()),
            forwarded_key_carriers: Some("header,params._meta".into()),
            dispatch_body_sha256: None,
            credential: Some("pay:2".into()),
            approval: None,
        }
    }

    #[test]
    fn a_row_maps_column_by_column() {
        let a = Attempt::try_from(row()).unwrap();
        assert_eq!(a.state, AttemptState::Completed);
        assert_eq!((a.cost, a.replay_count, a.round), (5, 2, 2));
        assert_eq!(
            (a.created_at_ms, a.updated_at_ms, a.lease_expires_at_ms),
            (1, 2, 3)
        );
        assert_eq!(a.finished_at_ms, Some(4));
        assert_eq!(a.capability_hash.as_deref(), Some("ch"));
        assert_eq!(a.forwarded_key.as_deref(), Some("fk"));
        assert_eq!(a.forwarded_key_carriers.to_list(), "header,params._meta");
        assert_eq!(
            a.credential,
            Some(CredentialUse {
                name: "pay".into(),
                version: 2
            })
        );
        assert_eq!(a.arguments.as_deref(), Some(r#"{"amount":5}"#));
        assert_eq!(a.resolution, None);
    }

    #[test]
    fn an_attempt_is_written_as_the_row_it_is_read_from() {
        let mut r = row();
        r.resolved_executed = Some(true);
        r.resolved_by = Some("ops".into());
        r.resolved_at = Some(9);
        r.resolution_note = Some("checked".into());
        r.resolution_source = Some("reconciler".into());
        r.provider_answer = Some(r#"{"status":"paid"}"#.into());
        r.dispatch_body_sha256 = Some("ab".into());
        let a = Attempt::try_from(r.clone()).unwrap();
        assert_eq!(AttemptRow::of(&a).unwrap(), r);
        assert_eq!(ATTEMPT_TABLE.len(), AttemptRow::NCOLS);
        assert!(ATTEMPT_COLS.starts_with("a.id, a.permit_id, "));
        assert!(ATTEMPT_COLS.ends_with(", a.dispatch_body_sha256, a.credential, a.approval"));
    }

    #[test]
    fn carriers_read_back_as_written_and_an_unknown_one_is_corrupt() {
        use crate::model::KeyCarrier;
        for carriers in [
            KeyCarriers::NONE,
            KeyCarriers::NONE.with(KeyCarrier::IdempotencyKeyParam),
            KeyCarrier::ALL.into_iter().collect(),
        ] {
            let mut r = row();
            r.forwarded_key_carriers = carriers_column(carriers);
            let a = Attempt::try_from(r).unwrap();
            assert_eq!(a.forwarded_key_carriers, carriers);
        }
        // Rows written before the column existed have none.
        let mut r = row();
        r.forwarded_key_carriers = None;
        assert!(Attempt::try_from(r)
            .unwrap()
            .forwarded_key_carriers
            .is_empty());
        let mut r = row();
        r.forwarded_key_carriers = Some("header,cookie".into());
        assert!(matches!(
            Attempt::try_from(r),
            Err(LedgerError::Corrupt(m)) if m.contains("cookie")
        ));
    }

    #[test]
    fn a_resolution_needs_all_three_columns() {
        let mut r = row();
        r.resolved_executed = Some(true);
        r.resolved_by = Some("ops".into());
        r.resolution_note = Some("checked".into());
        assert_eq!(Attempt::try_from(r.clone()).unwrap().resolution, None);
        r.resolved_at = Some(9);
        let res = Attempt::try_from(r.clone()).unwrap().resolution.unwrap();
        assert!(res.executed);
        assert_eq!((res.by.as_str(), res.at_ms), ("ops", 9));
        assert_eq!(res.note.as_deref(), Some("checked"));
        // Written before sources were kept: a person's.
        assert_eq!(res.source, ResolutionSource::Person);
        // The reconciler's resolution carries the provider's answer.
        r.resolution_source = Some("reconciler".into());
        r.provider_answer = Some(r#"{"status":"paid"}"#.into());
        let res = Attempt::try_from(r.clone()).unwrap().resolution.unwrap();
        assert_eq!(res.source.provider_answer(), Some(r#"{"status":"paid"}"#));
        // A reconciler's resolution without its evidence cannot be read back.
        r.provider_answer = None;
        assert!(matches!(Attempt::try_from(r), Err(LedgerError::Corrupt(_))));
    }

    #[test]
    fn an_unknown_state_or_a_negative_round_is_corrupt() {
        let mut r = row();
        r.state = "lost".into();
        assert!(matches!(Attempt::try_from(r), Err(LedgerError::Corrupt(_))));
        let mut r = row();
        r.round = -1;
        assert!(matches!(Attempt::try_from(r), Err(LedgerError::Corrupt(_))));
    }

    #[test]
    fn a_negative_count_reads_as_zero() {
        let mut r = row();
        r.cost = -3;
        r.replay_count = -1;
        let a = Attempt::try_from(r).unwrap();
        assert_eq!((a.cost, a.replay_count), (0, 0));
    }
}
