//! Stable stand-in for the cargo-fuzz target `shared/fuzz/fuzz_targets/frame_decoder.rs`:
//! random and mutated byte streams through the same decoder. Deterministic (fixed seeds).

use gpufeed_shared::proto::{
    decode_one, encode, encode_to_vec, Ack, EventFrame, FrameDecoder, Message, SpoolLoss,
    HEADER_LEN, MAX_FRAME_LEN,
};

/// Same body as the fuzz target; returns (messages, garbage frames, fatal error seen).
fn drive(data: &[u8], split: usize) -> (usize, usize, bool) {
    let _ = decode_one(data);
    let mut d = FrameDecoder::default();
    let (mut msgs, mut garbage) = (0, 0);
    for chunk in data.chunks(split.max(1)) {
        d.push(chunk);
        loop {
            match d.next_frame() {
                Ok(Some(m)) => {
                    let wire = encode_to_vec(&m).expect("re-encodes");
                    assert_eq!(decode_one(&wire).expect("round trip").0, m);
                    msgs += 1;
                }
                Ok(None) => break,
                Err(e) if e.is_fatal() => return (msgs, garbage, true),
                Err(_) => garbage += 1,
            }
        }
    }
    let _ = d.finish();
    (msgs, garbage, false)
}

fn valid_stream(rng: &mut fastrand::Rng, n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        let m = match rng.u64(..3) {
            0 => Message::Event(EventFrame {
                seq: i as u64,
                host_realtime_ns: rng.i64(..),
                host_monotonic_ns: rng.u64(..),
                kind: rng.u16(..20),
                payload: (0..rng.u64(..200)).map(|_| rng.u8(..)).collect(),
            }),
            1 => Message::Ack(Ack { up_to: rng.u64(..) }),
            _ => Message::SpoolLoss(SpoolLoss {
                dropped: rng.u64(..1000),
                first_seq: i as u64,
                last_seq: i as u64 + rng.u64(..1000),
            }),
        };
        encode(&m, &mut out).unwrap();
    }
    out
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = fastrand::Rng::with_seed(0x9E37_79B9_7F4A_7C15);
    for _ in 0..3000 {
        let len = rng.usize(..512);
        let data: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
        let split = 1 + rng.usize(..64);
        drive(&data, split);
    }
}

#[test]
fn mutated_valid_streams_never_panic_and_clean_ones_decode_fully() {
    let mut rng = fastrand::Rng::with_seed(42);
    for round in 0..500 {
        let n = 1 + rng.usize(..20);
        let clean = valid_stream(&mut rng, n);
        let n_frames = {
            let mut d = FrameDecoder::default();
            d.push(&clean);
            let mut n = 0;
            while d.next_frame().unwrap().is_some() {
                n += 1;
            }
            d.finish().unwrap();
            n
        };
        assert_eq!(drive(&clean, 1 + round % 17), (n_frames, 0, false));
        let mut data = clean.clone();
        for _ in 0..1 + rng.u64(..8) {
            let i = rng.usize(..data.len());
            match rng.u64(..3) {
                0 => data[i] = rng.u8(..),
                1 => {
                    data.truncate(i);
                }
                _ => data.insert(i, rng.u8(..)),
            }
            if data.is_empty() {
                break;
            }
        }
        drive(&data, 1 + rng.usize(..100));
    }
}

#[test]
fn hostile_lengths() {
    for len in [
        0u32,
        1,
        2,
        MAX_FRAME_LEN as u32,
        MAX_FRAME_LEN as u32 + 1,
        u32::MAX,
    ] {
        let mut data = len.to_le_bytes().to_vec();
        data.extend(std::iter::repeat_n(0xAA, 64));
        let (msgs, garbage, fatal) = drive(&data, 7);
        assert_eq!(msgs, 0);
        if len as usize > MAX_FRAME_LEN {
            assert!(fatal && garbage == 0, "len {len}");
        } else if len <= 2 {
            // The short body is garbage; the 0xAA.. that follow announce an oversize frame.
            assert!(garbage == 1 && fatal, "len {len}");
        }
    }
    assert_eq!(HEADER_LEN, 4);
}
