//! The no-op reference filter: a proxy-wasm root and HTTP context that do nothing. Every
//! Envoy callback still crosses into the V8 VM, so this measures the floor any Rust
//! proxy-wasm filter pays. Benchmarks only.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Noop))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Noop;

impl Context for Noop {}

impl HttpContext for Noop {}
