use super::*;

const SERVICE: &str = "service-token-of-32-bytes-or-more";
const SHARED: &str = "shared-admin-token-of-32-bytes-or-more";
const ANA: &str = "ana-token-of-32-bytes-or-more-0000";
const BOB: &str = "bob-token-of-32-bytes-or-more-0000";

fn fixed(shared: Option<&str>) -> FixedTokens {
    FixedTokens {
        admin_token: shared.map(str::to_string),
        service_token: SERVICE.into(),
    }
}

/// Replaces the file at `path` by one holding `text`, as an operator should: written beside it,
/// then renamed over it, so no reader sees it half written, and the change shows in the inode
/// even within one tick of the file system's clock.
pub(crate) fn replace_file(path: &Path, text: &str) {
    let beside = path.with_extension("new");
    std::fs::write(&beside, text).unwrap();
    std::fs::rename(&beside, path).unwrap();
}

fn names(set: &AdminSet) -> Vec<&str> {
    set.names().collect()
}

#[test]
fn a_file_names_its_admins_and_skips_comments_and_blank_lines() {
    let text = format!(
        "# admins of the ledger\n\n{}\n   \n  # ops\n{}\r\n",
        tokens_file_line("ana@example.org", ANA),
        tokens_file_line("bob.ops_1-x", BOB),
    );
    let set = AdminSet::parse(&text, &fixed(None)).unwrap();
    assert_eq!(names(&set), ["ana@example.org", "bob.ops_1-x"]);
    let ana = set.authenticate(ANA).unwrap();
    assert_eq!(ana.name, "ana@example.org");
    assert!(!ana.shared);
    assert_eq!(set.authenticate(BOB).unwrap().name, "bob.ops_1-x");
    assert_eq!(set.authenticate("not-a-token"), None);
    assert_eq!(set.authenticate(SERVICE), None);
    assert_eq!(set.authenticate(""), None);
    // Each admin's credential is its own, and is not the hash the file holds.
    let credential = set.credential_of("ana@example.org").unwrap();
    assert_eq!(credential, ana.credential);
    assert_ne!(Some(credential.clone()), set.credential_of("bob.ops_1-x"));
    assert!(!text.contains(&credential));
    assert_eq!(set.credential_of("carol"), None);
}

#[test]
fn the_shared_token_is_the_admin_named_admin_beside_the_file() {
    let text = tokens_file_line("ana", ANA);
    let set = AdminSet::parse(&text, &fixed(Some(SHARED))).unwrap();
    assert_eq!(names(&set), [SHARED_ADMIN_NAME, "ana"]);
    let admin = set.authenticate(SHARED).unwrap();
    assert_eq!(admin.name, "admin");
    assert!(admin.shared);
    assert_eq!(set.authenticate(ANA).unwrap().name, "ana");
    // An empty file is fine beside it; alone, nobody would be an admin.
    assert_eq!(
        names(&AdminSet::parse("", &fixed(Some(SHARED))).unwrap()),
        ["admin"]
    );
    assert_eq!(
        AdminSet::parse("# nobody\n\n", &fixed(None)).unwrap_err(),
        TokensFileError::NoAdmin
    );
    // Without --admin-token, a file may name an admin `admin`.
    let alone = AdminSet::parse(&tokens_file_line("admin", ANA), &fixed(None)).unwrap();
    assert!(!alone.authenticate(ANA).unwrap().shared);
}

#[test]
fn every_refusal_names_its_line_and_never_the_hash() {
    let ana = tokens_file_line("ana", ANA);
    let ana_hash = token_sha256(ANA);
    let cases: Vec<(String, TokensFileError)> = vec![
        (
            format!("# c\n{ana}\nbob\n"),
            TokensFileError::Malformed { line: 3 },
        ),
        (
            format!("{ana}\nbob {} extra\n", token_sha256(BOB)),
            TokensFileError::Malformed { line: 2 },
        ),
        (
            format!("bob{}\n", token_sha256(BOB)),
            TokensFileError::Malformed { line: 1 },
        ),
        (
            format!("\n\nbo b {}\n", token_sha256(BOB)),
            TokensFileError::Malformed { line: 3 },
        ),
        (
            format!("{ana}\nbob/ops {}\n", token_sha256(BOB)),
            TokensFileError::BadName { line: 2 },
        ),
        (
            format!("{} {}\n", "x".repeat(MAX_ADMIN_NAME_BYTES + 1), ana_hash),
            TokensFileError::BadName { line: 1 },
        ),
        (
            format!("{ana}\nbob {}\n", token_sha256(BOB).to_uppercase()),
            TokensFileError::BadHash { line: 2 },
        ),
        (
            format!("{ana}\nbob {}\n", &token_sha256(BOB)[..63]),
            TokensFileError::BadHash { line: 2 },
        ),
        (
            format!("{ana}\nbob {BOB}\n"),
            TokensFileError::BadHash { line: 2 },
        ),
        (
            format!("{ana}\n# bob\nana {}\n", token_sha256(BOB)),
            TokensFileError::DuplicateName {
                line: 3,
                name: "ana".into(),
                first: 1,
            },
        ),
        (
            format!("{ana}\n\nbob {ana_hash}\n"),
            TokensFileError::DuplicateHash { line: 3, first: 1 },
        ),
        (
            format!("{ana}\nsvc {}\n", token_sha256(SERVICE)),
            TokensFileError::ServiceToken { line: 2 },
        ),
    ];
    for (text, expected) in cases {
        let refused = AdminSet::parse(&text, &fixed(None)).unwrap_err();
        assert_eq!(refused, expected, "{text}");
        let message = refused.to_string();
        let line = match expected {
            TokensFileError::Malformed { line }
            | TokensFileError::BadName { line }
            | TokensFileError::BadHash { line }
            | TokensFileError::DuplicateName { line, .. }
            | TokensFileError::SharedName { line }
            | TokensFileError::DuplicateHash { line, .. }
            | TokensFileError::SharedHash { line }
            | TokensFileError::ServiceToken { line } => line,
            TokensFileError::NoAdmin => unreachable!(),
        };
        assert!(message.starts_with(&format!("line {line}: ")), "{message}");
        for hash in [token_sha256(ANA), token_sha256(BOB), token_sha256(SERVICE)] {
            assert!(!message.contains(&hash[..16]), "{message} shows a hash");
        }
    }
}

#[test]
fn the_shared_tokens_name_and_hash_are_refused_in_the_file() {
    let shared = fixed(Some(SHARED));
    assert_eq!(
        AdminSet::parse(
            &format!(
                "{}\n{}\n",
                tokens_file_line("ana", ANA),
                tokens_file_line("admin", BOB)
            ),
            &shared
        )
        .unwrap_err(),
        TokensFileError::SharedName { line: 2 }
    );
    let refused = AdminSet::parse(&tokens_file_line("ana", SHARED), &shared).unwrap_err();
    assert_eq!(refused, TokensFileError::SharedHash { line: 1 });
    assert!(refused.to_string().contains("--admin-token"), "{refused}");
}

#[test]
fn a_line_is_the_name_and_the_tokens_sha256() {
    assert_eq!(
        tokens_file_line("ana", "abc"),
        "ana ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    for good in [
        "a",
        "ana@example.org",
        "A.B_c-9",
        &"x".repeat(MAX_ADMIN_NAME_BYTES),
    ] {
        assert!(valid_admin_name(good), "{good}");
    }
    for bad in ["", "ana ops", "ana/ops", "äna", "ana\n", &"x".repeat(65)] {
        assert!(!valid_admin_name(bad), "{bad:?}");
    }
}

#[test]
fn the_file_is_read_again_when_it_changes_and_a_bad_one_keeps_the_last_good_set() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("admins");
    let both = format!(
        "{}\n{}\n",
        tokens_file_line("ana", ANA),
        tokens_file_line("bob", BOB)
    );
    std::fs::write(&path, &both).unwrap();
    let mut file = TokensFile::load(path.clone(), fixed(Some(SHARED))).unwrap();
    let admins = file.admins();
    assert_eq!(admins.authenticate(BOB).unwrap().name, "bob");
    assert!(matches!(file.check(), ReloadCheck::Unchanged));

    // Bob removed: refused from this check on; the others stay.
    replace_file(&path, &format!("{}\n", tokens_file_line("ana", ANA)));
    assert!(matches!(file.check(), ReloadCheck::Reloaded));
    assert_eq!(admins.authenticate(BOB), None);
    assert_eq!(admins.credential_of("bob"), None);
    assert_eq!(admins.authenticate(ANA).unwrap().name, "ana");
    assert_eq!(admins.authenticate(SHARED).unwrap().name, "admin");

    // A broken file: refused once, naming its line; the last good set stays.
    replace_file(&path, "ana not-a-hash\n");
    match file.check() {
        ReloadCheck::Failed(e) => assert!(e.to_string().contains("line 1:"), "{e}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(matches!(file.check(), ReloadCheck::Unchanged));
    assert_eq!(admins.authenticate(ANA).unwrap().name, "ana");

    // Gone for a moment: one failure, then quiet; back, it is read again.
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(file.check(), ReloadCheck::Failed(_)));
    assert!(matches!(file.check(), ReloadCheck::Unchanged));
    assert_eq!(admins.authenticate(ANA).unwrap().name, "ana");
    std::fs::write(&path, &both).unwrap();
    assert!(matches!(file.check(), ReloadCheck::Reloaded));
    assert_eq!(admins.authenticate(BOB).unwrap().name, "bob");
}

#[test]
fn a_refused_file_stops_the_start_naming_the_flag_and_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("admins");
    std::fs::write(&path, format!("# x\n{}\n", tokens_file_line("admin", ANA))).unwrap();
    let refused = TokensFile::load(path.clone(), fixed(Some(SHARED)))
        .err()
        .unwrap()
        .to_string();
    assert!(
        refused.starts_with("--admin-tokens-file ") && refused.contains("line 2:"),
        "{refused}"
    );
    let missing = TokensFile::load(dir.path().join("nowhere"), fixed(None))
        .err()
        .unwrap()
        .to_string();
    assert!(missing.contains("cannot be read"), "{missing}");
}
