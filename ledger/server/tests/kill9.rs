//! The embedded store survives `kill -9`: a committed decision is there after a restart.

#![cfg(all(unix, feature = "sqlite"))]

#[cfg(test)]
mod kill9 {
    use std::net::TcpListener;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use serde_json::{json, Value};

    const SVC: &str = "svc-token-kill9-of-32-bytes-or-more";
    const ADM: &str = "adm-token-kill9-of-32-bytes-or-more";

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[allow(clippy::zombie_processes)] // the caller kills and waits
    fn start(port: u16, admin_port: u16, dir: &std::path::Path) -> Child {
        let child = Command::new(env!("CARGO_BIN_EXE_atmost"))
            .args([
                "ledger",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--admin-listen",
                &format!("127.0.0.1:{admin_port}"),
                "--data-dir",
            ])
            .arg(dir)
            .env("ATMOST_SERVICE_TOKEN", SVC)
            .env("ATMOST_ADMIN_TOKEN", ADM)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let http = reqwest::blocking::Client::new();
        while Instant::now() < deadline {
            if let Ok(r) = http.get(format!("http://127.0.0.1:{port}/readyz")).send() {
                if r.status().is_success() {
                    return child;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("ledger did not become ready");
    }

    fn post(port: u16, path: &str, token: &str, body: Value) -> Value {
        let r = reqwest::blocking::Client::new()
            .post(format!("http://127.0.0.1:{port}{path}"))
            .bearer_auth(token)
            .json(&body)
            .send()
            .unwrap();
        assert!(r.status().is_success(), "{path}: {}", r.status());
        r.json().unwrap()
    }

    #[test]
    fn committed_state_survives_kill_9() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let admin_port = free_port();
        let mut child = start(port, admin_port, dir.path());
        let created = post(
            admin_port,
            "/admin/v1/permits",
            ADM,
            json!({"label": "k9", "expires": "1h", "max_calls": {"pay": 2}}),
        );
        let tok = created["token"].as_str().unwrap().to_string();
        let ask = |port: u16, key: &str| {
            post(
                port,
                "/v1/authorize",
                SVC,
                json!({"permit_token": tok, "tool": "pay", "idempotency_key": key, "fingerprint": key}),
            )
        };
        let a = ask(port, "done");
        let attempt = a["attempt_id"].as_str().unwrap().to_string();
        let acks = post(
            port,
            "/v1/outcomes",
            SVC,
            json!({"reports": [{"attempt_id": attempt, "round": a["round"], "capability": a["capability"],
                "outcome": "completed", "receipt": "RECEIPT"}]}),
        );
        assert_eq!(acks, json!({"acks": ["applied"]}));
        assert_eq!(ask(port, "flying")["decision"], "dispatch");
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        let port = free_port();
        let mut child = start(port, free_port(), dir.path());
        let done = ask(port, "done");
        assert_eq!(
            done,
            json!({"decision": "replay", "attempt_id": attempt, "receipt": "RECEIPT",
                   "limits": {"calls_left": 0, "budget_left": null, "expires_at": done["limits"]["expires_at"]}})
        );
        assert_eq!(ask(port, "flying")["code"], "idempotency_in_progress");
        assert_eq!(ask(port, "third")["code"], "permit_max_calls_exceeded");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
