//! The stream library's behaviour, in one test binary (a change relinks this one, not one per
//! file): the whole stream in memory on both sans-IO cores (`sim`), the frame decoder on
//! random and mutated input (`frames_random`), and the real hub against hostile frames from an
//! authenticated host over QUIC (`frames`). The tests that need the host agent (its binary,
//! its configuration, its routing of the event bus, its series as host state, the child
//! processes it is killed in) stay in `host-agent/tests/stream_*.rs`; so do `stream_flood`,
//! which measures its process's memory, and `stream_faults`, whose host restarts can cut a
//! frame and so log the truncation warnings whose number `frames` checks in the same log
//! capture.

mod frames;
mod frames_random;
mod sim;
mod support;
