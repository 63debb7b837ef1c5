#![no_main]
//! Feeds arbitrary bytes to the frame decoder, split into arbitrary chunks: it must never
//! panic, and every decoded message must re-encode to a frame that decodes to itself.
use gpufeed_shared::proto::{decode_one, encode_to_vec, FrameDecoder};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_one(data);
    let split = data.first().copied().unwrap_or(1).max(1) as usize;
    let mut d = FrameDecoder::default();
    for chunk in data.chunks(split) {
        d.push(chunk);
        loop {
            match d.next_frame() {
                Ok(Some(m)) => {
                    let wire = encode_to_vec(&m).expect("a decoded message re-encodes");
                    assert_eq!(decode_one(&wire).expect("round trip").0, m);
                }
                Ok(None) => break,
                Err(e) if e.is_fatal() => return,
                Err(_) => {}
            }
        }
    }
    let _ = d.finish();
});
