use super::*;
use serde_json::json;

#[test]
fn json_bodies() {
    let body = br#"{"jsonrpc":"2.0","id":5,"result":{"ok":true}}"#;
    assert_eq!(
        from_json_body(body, &json!(5)),
        Some(Captured {
            text: r#"{"jsonrpc":"2.0","id":5,"result":{"ok":true}}"#.into(),
            kind: ResultKind::Final
        })
    );
    assert_eq!(from_json_body(body, &json!(6)), None);
    assert_eq!(from_json_body(body, &json!("5")), None);
    let err = br#"{"jsonrpc":"2.0","id":"a","error":{"code":-32602,"message":"x"}}"#;
    assert!(from_json_body(err, &json!("a")).is_some());
    // A server request reusing the id is not a response.
    let req = br#"{"jsonrpc":"2.0","id":5,"method":"sampling/createMessage","params":{}}"#;
    assert_eq!(from_json_body(req, &json!(5)), None);
    let batch =
        br#"[{"jsonrpc":"2.0","id":4,"result":{}},{"jsonrpc":"2.0","id":5,"result":{"n":1}}]"#;
    assert_eq!(
        from_json_body(batch, &json!(5)).and_then(|c| serde_json::from_str::<Value>(&c.text).ok()),
        Some(json!({"jsonrpc":"2.0","id":5,"result":{"n":1}}))
    );
    assert_eq!(from_json_body(b"not json", &json!(5)), None);
    assert_eq!(from_json_body(&[0xff, 0xfe], &json!(5)), None);
}

#[test]
fn sse_stream_finds_the_final_response() {
    let stream = "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n\
                  data: {\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"elicitation/create\",\"params\":{}}\n\n\
                  data: {\"jsonrpc\":\"2.0\",\"id\":9,\r\ndata: \"result\":{\"content\":[]}}\r\n\r\n";
    let bytes = stream.as_bytes();
    for split in 0..bytes.len() {
        let mut cap = SseCapture::new(json!(9), 1 << 20);
        let mut found = None;
        for part in [&bytes[..split], &bytes[split..]] {
            if let SseProgress::Found(r) = cap.feed(part) {
                found = Some(r);
            }
        }
        assert_eq!(
            found.map(|c| c.text).as_deref(),
            Some("{\"jsonrpc\":\"2.0\",\"id\":9,\n\"result\":{\"content\":[]}}"),
            "split at {split}"
        );
    }
}

#[test]
fn result_kinds() {
    for (text, kind) in [
        (
            r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#,
            ResultKind::Final,
        ),
        (
            r#"{"jsonrpc":"2.0","id":1,"error":{"code":1,"message":"m"}}"#,
            ResultKind::Final,
        ),
        ("not json", ResultKind::Final),
        (
            r#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"complete","content":[]}}"#,
            ResultKind::Final,
        ),
        (
            r#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"input_required","inputRequests":{},"requestState":"s"}}"#,
            ResultKind::InputRequired,
        ),
        (
            r#"{"jsonrpc":"2.0","id":1,"result":{"task":{"taskId":"t1","status":"working","createdAt":"x","lastUpdatedAt":"x","ttl":null}}}"#,
            ResultKind::Task,
        ),
        (
            r#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"task","task":{"taskId":"t1"}}}"#,
            ResultKind::Task,
        ),
        // A tool result that happens to hold a `task` field is still a result.
        (
            r#"{"jsonrpc":"2.0","id":1,"result":{"content":[],"task":{"taskId":"t1"}}}"#,
            ResultKind::Final,
        ),
    ] {
        assert_eq!(kind_of(text), kind, "{text}");
        // Captured responses carry the same kind, read from the one parse.
        if let Some(c) = from_json_text(text, &json!(1)) {
            assert_eq!(c.kind, kind, "{text}");
        }
    }
}

/// The reading without the tree finds what the tree finds, of every kind of text.
#[test]
fn a_lone_message_reads_as_its_tree_reads() {
    let texts = [
        r#"{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"ok"}]}}"#,
        r#"{"id":1,"result":null}"#,
        r#"{"id":1,"result":[1,{"a":[]}]}"#,
        r#"{"id":1,"error":{"code":1,"message":"m"}}"#,
        r#"{"id":1,"method":"x","result":{}}"#,
        r#"{"id":1,"method":null,"error":{}}"#,
        r#"{"id":1}"#,
        r#"{"id":2,"result":{}}"#,
        r#"{"id":"1","result":{}}"#,
        r#"{"id":1.0,"result":{}}"#,
        r#"{"id":2,"id":1,"result":{}}"#,
        r#"{"id":1,"id":2,"result":{}}"#,
        r#"{"\u0069d":1,"r\u0065sult":{"resultType":"task"}}"#,
        r#"{"id":1,"result":{"resultType":"input_required"}}"#,
        r#"{"id":1,"result":{"resultType":"task","resultType":5}}"#,
        r#"{"id":1,"result":{"resultType":5,"resultType":"input_required"}}"#,
        r#"{"id":1,"result":{"task":{"taskId":"t"}}}"#,
        r#"{"id":1,"result":{"task":{"taskId":"t"},"content":null}}"#,
        r#"{"id":1,"result":{"task":{"taskId":"t","taskId":1}}}"#,
        r#"{"id":1,"result":{"task":{"taskId":1,"taskId":"t"}}}"#,
        r#"{"id":1,"result":{"task":"t"}}"#,
        r#"{"id":1,"result":{"task":{"taskId":"t"}},"result":{"content":[]}}"#,
        r#"{"id":1,"result":{"resultType":"task"},"result":5}"#,
        r#"{"id":1,"result":{"n":1e400}}"#,
        r#"{"id":1,"result":{"s":"\ud800"}}"#,
        r#"{"id":1,"result":{}} x"#,
        r#"{"id":1,"result":{},}"#,
        r#"[{"id":1,"result":{"resultType":"task"}}]"#,
        r#"[{"id":2,"result":{}},{"id":1,"error":{}}]"#,
        r#"[]"#,
        r#"1"#,
        r#""s""#,
        r#"null"#,
        " \n {\"id\" : 1 , \"result\" : { } } \n ",
    ];
    let deep = format!(
        "{{\"id\":1,\"result\":{}{}}}",
        "[".repeat(200),
        "]".repeat(200)
    );
    for text in texts.iter().copied().chain([deep.as_str()]) {
        for id in [json!(1), json!("1"), json!(2)] {
            assert_eq!(
                from_json_text(text, &id),
                from_tree(text, &id),
                "{text} {id}"
            );
        }
    }
}

#[test]
fn a_batch_element_keeps_its_own_kind() {
    let batch = r#"[{"jsonrpc":"2.0","id":1,"result":{"content":[]}},{"jsonrpc":"2.0","id":2,"result":{"resultType":"input_required","requestState":"s"}}]"#;
    assert_eq!(
        from_json_text(batch, &json!(2)).map(|c| c.kind),
        Some(ResultKind::InputRequired)
    );
    assert_eq!(
        from_json_text(batch, &json!(1)).map(|c| c.kind),
        Some(ResultKind::Final)
    );
}

#[test]
fn sse_too_large() {
    let mut cap = SseCapture::new(json!(1), 10);
    assert_eq!(
        cap.feed(b"data: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n"),
        SseProgress::TooLarge
    );
}

/// The buffer in which the response was found, the event, and the stream offset of the
/// buffer's first byte.
type FoundIn = (Vec<u8>, Event, u64);

/// Passes `stream` cut at `cuts` through a capture for id 9 the way Envoy offers it: a
/// held buffer comes back with the next chunk after it. Returns what went on at each
/// callback, and where the response was found.
fn pass_all(stream: &[u8], cuts: &[usize]) -> (Vec<Vec<u8>>, Option<FoundIn>) {
    let mut cap = SseCapture::new(json!(9), 1 << 20);
    let mut out = Vec::new();
    let mut found = None;
    let mut buffer = Vec::new();
    let mut from = 0;
    let ends: Vec<usize> = cuts.iter().copied().chain([stream.len()]).collect();
    for (n, &to) in ends.iter().enumerate() {
        buffer.extend_from_slice(&stream[from..to]);
        from = to;
        let p = cap.pass(&buffer, n + 1 == ends.len());
        if let (SseProgress::Found(_), Some((e, base))) = (&p.progress, p.found) {
            found = Some((buffer.clone(), e, base));
        }
        if p.hold {
            out.push(Vec::new());
        } else {
            out.push(std::mem::take(&mut buffer));
        }
    }
    (out, found)
}

const STREAM: &str = "id: 1\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n\
                      id: 2\r\ndata: {\"jsonrpc\":\"2.0\",\"id\":9,\r\ndata: \"result\":{\"content\":[]}}\r\n\r\n: bye\n";

#[test]
fn a_split_response_event_is_held_until_whole_and_nothing_is_lost() {
    let bytes = STREAM.as_bytes();
    let second = STREAM.find("id: 2").unwrap_or(0);
    for cut in 1..bytes.len() {
        let (out, found) = pass_all(bytes, &[cut]);
        assert_eq!(out.concat(), bytes, "cut at {cut}");
        let (buffer, e, base) = found.unwrap_or_else(|| panic!("not found, cut at {cut}"));
        // The whole event is in the buffer, at the offsets the event gives.
        let start = usize::try_from(e.start - base).unwrap_or(usize::MAX);
        let end = usize::try_from(e.end - base).unwrap_or(usize::MAX);
        assert_eq!(
            &buffer[start..end],
            &bytes[second..second + (end - start)],
            "cut at {cut}"
        );
        assert_eq!(
            e.data,
            "{\"jsonrpc\":\"2.0\",\"id\":9,\n\"result\":{\"content\":[]}}"
        );
        // A first chunk that ends between events goes on at once.
        if cut == second {
            assert_eq!(out[0], &bytes[..second]);
        }
    }
}

#[test]
fn chunks_ending_between_events_go_on_as_they_came() {
    let mut cap = SseCapture::new(json!(9), 1 << 20);
    let p = cap.pass(b"data: {\"jsonrpc\":\"2.0\",\"method\":\"x\"}\n\n", false);
    assert_eq!(
        (p.progress, p.hold, p.found),
        (SseProgress::Pending, false, None)
    );
    assert_eq!(cap.held(), 0);
    // A buffer ending in a partial event is held, and is not scanned twice when it comes
    // back with the next chunk.
    let p = cap.pass(b"data: {\"jsonrpc\"", false);
    assert!(p.hold);
    assert_eq!(cap.held(), 16);
    let p = cap.pass(
        b"data: {\"jsonrpc\":\"2.0\",\"id\":9,\"result\":{}}\n\n",
        false,
    );
    assert!(!p.hold);
    assert!(matches!(p.progress, SseProgress::Found(_)));
    assert_eq!(p.found.map(|(e, base)| (e.start, base)), Some((38, 38)));
    // At the end of the stream nothing is held.
    let mut cap = SseCapture::new(json!(9), 1 << 20);
    let p = cap.pass(b"data: {\"unfinished\"", true);
    assert!(!p.hold);
    assert_eq!(cap.held(), 0);
}

#[test]
fn the_trailers_end_a_held_stream_without_scanning_it_again() {
    let mut cap = SseCapture::new(json!(9), 1 << 20);
    assert!(cap.pass(b"id: 3\ndata: {\"jsonrpc\"", false).hold);
    let p = cap.pass(b"id: 3\ndata: {\"jsonrpc\"", true);
    assert_eq!(
        (p.progress, p.hold, p.found),
        (SseProgress::Pending, false, None)
    );
    assert_eq!(cap.held(), 0);
    assert_eq!(cap.last_event_id(), None, "the unfinished event set no id");
}

#[test]
fn holding_gives_up_past_the_event_limit_and_then_finds_no_whole_event() {
    let mut cap = SseCapture::new(json!(9), 64);
    // Comment lines do not count against the event's data, but the held bytes do.
    let mut buffer = b"id: 1\n".to_vec();
    assert!(cap.pass(&buffer, false).hold);
    let comment = format!(": {}\n", "x".repeat(37));
    buffer.extend_from_slice(comment.as_bytes());
    assert!(cap.pass(&buffer, false).hold, "46 bytes held");
    buffer.extend_from_slice(comment.as_bytes());
    let p = cap.pass(&buffer, false);
    assert!(!p.hold, "86 bytes would be held: they go on");
    assert_eq!(cap.held(), 0);
    let p = cap.pass(
        b"data: {\"jsonrpc\":\"2.0\",\"id\":9,\"result\":{}}\n\n",
        false,
    );
    assert!(matches!(p.progress, SseProgress::Found(_)));
    assert_eq!(
        (p.hold, p.found),
        (false, None),
        "the event began in bytes already gone"
    );
}

#[test]
fn a_refused_edit_stops_holding() {
    let mut cap = SseCapture::new(json!(9), 1 << 20);
    assert!(cap.pass(b"data: {", false).hold);
    cap.stop_holding();
    let p = cap.pass(b"data: {}\n\ndata: {", false);
    assert!(!p.hold);
    assert_eq!(cap.held(), 0);
}
