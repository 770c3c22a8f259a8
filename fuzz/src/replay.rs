//! `replay`: a stored receipt and the current request's id → the replayed answer; and the
//! receipt capture that produces receipts (`receipt::from_json_body`, `SseCapture`).
//!
//! Input: up to the first NUL byte is the JSON-RPC id (as JSON; a string when it is not a
//! valid string or number), the rest is the receipt / response body. Asserts:
//! - `replay::rewrite` never panics; when it accepts, the answer is an object whose `id` is
//!   the current id, a `result` object carries `_meta["dev.atmost/replayed"] = true` and
//!   keeps every other field, an `error` is kept as stored; `render` is HTTP 200 JSON with
//!   `idempotent-replayed: true`;
//! - a receipt found in a JSON body is a JSON-RPC response to that id (result or error, no
//!   method) and replays; `receipt::kind_of` never panics;
//! - fed as an SSE stream in two pieces or whole, the capture finds the same receipt.

use atmost_filter::call::receipt::{self, SseCapture, SseProgress};
use atmost_filter::call::replay::{self, REPLAYED_HEADER, REPLAYED_META};
use serde_json::Value;

fn check_rewrite(receipt: &str, id: &Value) {
    let Ok(out) = replay::rewrite(receipt, id) else {
        assert!(!matches!(
            serde_json::from_str::<Value>(receipt),
            Ok(Value::Object(_))
        ));
        return;
    };
    let stored: Value = match serde_json::from_str(receipt) {
        Ok(v) => v,
        Err(e) => panic!("rewrite accepted a receipt that is not JSON: {e}"),
    };
    assert_eq!(out.get("id"), Some(id));
    if let Some(Value::Object(result)) = stored.get("result") {
        let new = &out["result"];
        assert_eq!(new["_meta"][REPLAYED_META], Value::Bool(true), "{out}");
        for (k, v) in result {
            if k != "_meta" {
                assert_eq!(&new[k], v, "result.{k} changed");
            }
        }
        if let Some(Value::Object(meta)) = result.get("_meta") {
            for (k, v) in meta {
                if k != REPLAYED_META {
                    assert_eq!(&new["_meta"][k], v, "result._meta.{k} changed");
                }
            }
        }
    }
    for (k, v) in stored.as_object().into_iter().flatten() {
        if k != "id" && k != "result" {
            assert_eq!(&out[k], v, "{k} changed");
        }
    }
    match replay::render(receipt, id, None) {
        Ok(r) => {
            assert_eq!(r.status, 200);
            assert_eq!(r.header(REPLAYED_HEADER), Some("true"));
            assert_eq!(r.body_json().as_ref(), Some(&out));
        }
        Err(_) => panic!("render refused what rewrite accepted"),
    }
}

fn assert_response_to(text: &str, id: &Value) {
    let v: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => panic!("captured receipt is not JSON ({e}): {text}"),
    };
    assert_eq!(v.get("id"), Some(id), "{text}");
    assert!(v.get("method").is_none());
    assert!(v.get("result").is_some() || v.get("error").is_some());
}

pub fn check(data: &[u8]) {
    let (id_part, rest) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (&b"1"[..], data),
    };
    let id = match serde_json::from_slice::<Value>(id_part) {
        Ok(v) if v.is_string() || v.is_number() => v,
        _ => Value::String(String::from_utf8_lossy(id_part).into_owned()),
    };
    let text = String::from_utf8_lossy(rest);

    check_rewrite(&text, &id);
    let _ = receipt::kind_of(&text);

    let found = receipt::from_json_body(rest, &id);
    if let Some(c) = &found {
        let r = &c.text;
        assert_response_to(r, &id);
        // The kind read along with the capture is the kind of the text it kept.
        assert_eq!(c.kind, receipt::kind_of(r), "{r}");
        check_rewrite(r, &id);
        assert!(
            replay::rewrite(r, &id).is_ok(),
            "a captured receipt does not replay: {r}"
        );
    }

    // The same bytes as an SSE stream, whole and in two pieces.
    let run = |pieces: &[&[u8]]| {
        let mut cap = SseCapture::new(id.clone(), 1 << 16);
        for p in pieces {
            match cap.feed(p) {
                SseProgress::Found(r) => return Some(r),
                SseProgress::TooLarge => return None,
                SseProgress::Pending => {}
            }
        }
        None
    };
    let whole = run(&[rest]);
    let mid = rest.len() / 2;
    assert_eq!(
        whole,
        run(&[&rest[..mid], &rest[mid..]]),
        "SSE capture depends on the split"
    );
    if let Some(c) = &whole {
        assert_response_to(&c.text, &id);
        assert_eq!(c.kind, receipt::kind_of(&c.text), "{}", c.text);
        check_rewrite(&c.text, &id);
    }
}
