//! The proxy-wasm adapter (wasm32 only): turns Envoy's callbacks into events for
//! [`crate::call::Call`] and carries out the effects it returns. No decisions live here.
//!
//! Root context id: `atmost` (the `root_id` in Envoy's plugin config). One VM is
//! single-threaded: the root context and its HTTP contexts share the
//! [`crate::report::Reporter`] (report queue, batch of completion reports) and the
//! metric ids through `Rc`.

mod host;
mod http;
mod root;
mod shared;
mod verify;

use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    std::panic::set_hook(Box::new(|info| {
        // The payload of our own code never carries secrets; the location helps debugging.
        let at = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        host::log(
            crate::call::Level::Error,
            &format!("atmost: panic at {at}; this VM fails and Envoy applies the failure_policy"),
        );
    }));
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::new(context_id))
    });
}}
