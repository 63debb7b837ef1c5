//! Where the host event stream stands (off, waiting for its TLS files, or up), shared by the
//! code that starts it, `/readyz` and the doctor.

use std::sync::{Arc, RwLock};

use crate::hub::Hub;

/// Where the host stream stands.
#[derive(Clone)]
pub enum StreamState {
    /// Not asked for (no `--quic-listen`).
    Off,
    /// Asked for, not started: why.
    Waiting(String),
    Up(Hub),
}

/// The host stream's state, shared by the starter, `/readyz` and the doctor.
#[derive(Clone)]
pub struct Stream(Arc<RwLock<StreamState>>);

impl Stream {
    pub fn new(state: StreamState) -> Stream {
        Stream(Arc::new(RwLock::new(state)))
    }

    pub fn get(&self) -> StreamState {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn set(&self, s: StreamState) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = s;
    }

    /// Why the agent is not ready as far as the stream goes.
    pub fn not_ready(&self) -> Option<String> {
        match self.get() {
            StreamState::Waiting(why) => Some(format!("host stream not started: {why}")),
            StreamState::Off | StreamState::Up(_) => None,
        }
    }
}
