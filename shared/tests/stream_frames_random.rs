//! Stable stand-in for the cargo-fuzz target `shared/fuzz/fuzz_targets/frame_decoder.rs`:
//! random and mutated byte streams through the same decoder. Deterministic (fixed seeds).

use gpufeed_shared::proto::{
    decode_one, encode, encode_to_vec, Ack, EventFrame, FrameDecoder, Message, SpoolLoss,
    HEADER_LEN, MAX_FRAME_LEN,
};

/// xorshift64*, enough for test input.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

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

fn valid_stream(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        let m = match rng.below(3) {
            0 => Message::Event(EventFrame {
                seq: i as u64,
                host_realtime_ns: rng.next() as i64,
                host_monotonic_ns: rng.next(),
                kind: rng.below(20) as u16,
                payload: (0..rng.below(200)).map(|_| rng.next() as u8).collect(),
            }),
            1 => Message::Ack(Ack { up_to: rng.next() }),
            _ => Message::SpoolLoss(SpoolLoss {
                dropped: rng.below(1000),
                first_seq: i as u64,
                last_seq: i as u64 + rng.below(1000),
            }),
        };
        encode(&m, &mut out).unwrap();
    }
    out
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for _ in 0..3000 {
        let len = rng.below(512) as usize;
        let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let split = 1 + rng.below(64) as usize;
        drive(&data, split);
    }
}

#[test]
fn mutated_valid_streams_never_panic_and_clean_ones_decode_fully() {
    let mut rng = Rng(42);
    for round in 0..500 {
        let n = 1 + rng.below(20) as usize;
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
        for _ in 0..1 + rng.below(8) {
            let i = rng.below(data.len() as u64) as usize;
            match rng.below(3) {
                0 => data[i] = rng.next() as u8,
                1 => {
                    data.truncate(i);
                }
                _ => data.insert(i, rng.next() as u8),
            }
            if data.is_empty() {
                break;
            }
        }
        drive(&data, 1 + rng.below(100) as usize);
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
