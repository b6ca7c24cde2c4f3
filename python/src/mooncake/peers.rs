//! Peers: whether one answers, the first buffer a segment publishes, the notifications
//! received, and Mooncake's EFA pre-connect (nothing to do here).

use pyo3::prelude::*;

use super::MooncakeEngine;
use crate::errors::log_failure;

#[pymethods]
impl MooncakeEngine {
    /// The address of the first buffer a segment publishes (fetched afresh), 0 if none.
    fn get_first_buffer_address(&self, py: Python<'_>, segment_name: Option<String>) -> u64 {
        let Some(state) = self.ready(py, "get_first_buffer_address") else {
            return 0;
        };
        let Some(name) = segment_name else {
            log_failure(py, "get_first_buffer_address: segment_name is None");
            return 0;
        };
        let found = py.detach(|| -> Result<Option<u64>, tern_engine::EngineError> {
            let engine = &state.core.engine;
            let segment = engine.open_segment(&name)?;
            engine.refresh_segment(segment)?;
            Ok(engine
                .segment(segment)
                .and_then(|peer| peer.desc.buffers.first().map(|b| b.addr)))
        });
        match found {
            Ok(Some(addr)) => addr,
            Ok(None) => {
                log_failure(
                    py,
                    &format!("get_first_buffer_address: {name} has no buffers"),
                );
                0
            }
            Err(e) => {
                log_failure(py, &format!("get_first_buffer_address({name}): {e}"));
                0
            }
        }
    }

    /// The notifications received so far, as `(name, msg)` pairs (the Python class turns
    /// them into `TransferNotify`); empty before `initialize`.
    fn get_notifies(&self, py: Python<'_>) -> Vec<(String, String)> {
        self.ready(py, "get_notifies")
            .map_or_else(Vec::new, |state| state.core.take_notifies())
    }

    /// Whether a peer answers: 0, or a negative code (-200: its metadata cannot be found).
    fn send_probe(&self, py: Python<'_>, peer_server_name: Option<String>) -> i32 {
        let Some(state) = self.ready(py, "send_probe") else {
            return -1;
        };
        let Some(peer) = peer_server_name else {
            log_failure(py, "send_probe: peer_server_name is None");
            return -1;
        };
        let probed = py.detach(|| {
            let engine = &state.core.engine;
            let segment = engine.open_segment(&peer)?;
            let outcome = engine.probe(segment);
            if outcome.is_err() {
                let _ = engine.close_segment(segment);
            }
            outcome
        });
        match probed {
            Ok(()) => 0,
            Err(e) => {
                log_failure(py, &format!("send_probe({peer}): {e}"));
                match e.mooncake_code() {
                    -102 | -103 => -200,
                    code => code,
                }
            }
        }
    }

    /// EFA pre-connect in Mooncake; nothing to do here.
    #[pyo3(signature = (segment_name = None))]
    fn warmup_efa_segment(&self, segment_name: Option<String>) -> i32 {
        let _ = segment_name;
        0
    }
}
