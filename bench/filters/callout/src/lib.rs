//! The one-callout reference filter: holds each request until its body has arrived, makes
//! ONE HTTP callout (`dispatch_http_call`, HTTP/2 to the cluster `atmost_ledger`, which the
//! benchmark points at a static stub), and resumes the request when the answer comes. It
//! reads and parses nothing: the floor for "one callout per call". Benchmarks only.
//!
//! With `"two_callouts": true` anywhere in its plugin configuration it also holds the last
//! chunk of each response and makes a second callout before releasing it: the floor for
//! "authorize, then report completion in-band" (two callouts per call).

use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { two_callouts: false }) });
}}

const BODY: &[u8] = br#"{"permit_token":"bench","tool":"echo","fingerprint":"0"}"#;

struct Root {
    two_callouts: bool,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        if let Ok(Some(config)) = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size) {
            self.two_callouts = config
                .windows(b"\"two_callouts\": true".len())
                .any(|w| w == b"\"two_callouts\": true");
        }
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(OneCallout {
            waiting: false,
            two_callouts: self.two_callouts,
            in_response: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct OneCallout {
    waiting: bool,
    two_callouts: bool,
    in_response: bool,
}

impl OneCallout {
    fn call_out(&mut self) -> Action {
        let headers = vec![
            (":method", "POST"),
            (":path", "/v1/authorize"),
            (":authority", "atmost-ledger"),
            ("content-type", "application/json"),
        ];
        match hostcalls::dispatch_http_call(
            "atmost_ledger",
            headers,
            Some(BODY),
            Vec::new(),
            Duration::from_secs(1),
        ) {
            Ok(_) => {
                self.waiting = true;
                Action::Pause
            }
            Err(_) => {
                let _ = hostcalls::send_http_response(503, Vec::new(), None);
                Action::Pause
            }
        }
    }
}

impl Context for OneCallout {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        _headers: usize,
        _body: usize,
        _trailers: usize,
    ) {
        self.waiting = false;
        if self.in_response {
            let _ = hostcalls::resume_http_response();
        } else {
            let _ = hostcalls::resume_http_request();
        }
    }
}

impl HttpContext for OneCallout {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            return self.call_out();
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, _body_size: usize, end_of_stream: bool) -> Action {
        if self.waiting {
            return Action::Pause;
        }
        if end_of_stream {
            return self.call_out();
        }
        Action::Pause
    }

    fn on_http_response_body(&mut self, _body_size: usize, end_of_stream: bool) -> Action {
        if !self.two_callouts || !end_of_stream {
            return Action::Continue;
        }
        self.in_response = true;
        self.call_out()
    }
}
