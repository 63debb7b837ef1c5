//! Frame codec: `u32` little-endian body length, then the postcard encoding of one
//! [`Message`]. Bodies are capped at [`MAX_FRAME_LEN`]; decoding never panics.

use std::sync::Arc;

use super::message::{Message, MAX_FRAME_LEN};

/// Bytes of the length prefix.
pub const HEADER_LEN: usize = 4;

/// Why a frame could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The length prefix announces more than the cap. The stream cannot be resynchronised and
    /// must be closed.
    #[error("oversize frame: {len} bytes announced, limit {max}")]
    Oversize { len: usize, max: usize },
    /// The input ended inside a frame.
    #[error("truncated frame: {have} of {need} bytes")]
    Truncated { need: usize, have: usize },
    /// A complete frame whose body is not a valid message (bad postcard, trailing bytes, empty
    /// body). The frame was consumed; the stream may continue with the next one.
    #[error("garbage frame of {len} bytes: {detail}")]
    Garbage { len: usize, detail: String },
}

impl DecodeError {
    /// Label value for `gpufeed_stream_frames_rejected_total{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::Oversize { .. } => "oversize",
            DecodeError::Truncated { .. } => "truncated",
            DecodeError::Garbage { .. } => "garbage",
        }
    }

    /// Whether the stream must be closed (the frame boundary is lost).
    pub fn is_fatal(&self) -> bool {
        !matches!(self, DecodeError::Garbage { .. })
    }
}

/// Why a message could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("message of {len} bytes exceeds the frame limit of {max}")]
    Oversize { len: usize, max: usize },
    #[error("postcard: {0}")]
    Postcard(#[from] postcard::Error),
}

/// Appends one frame (prefix + body) for `msg` to `out`. On error `out` is left unchanged.
pub fn encode(msg: &Message, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let start = out.len();
    out.extend_from_slice(&[0; HEADER_LEN]);
    let res = postcard::to_io(msg, &mut *out);
    if let Err(e) = res {
        out.truncate(start);
        return Err(e.into());
    }
    let len = out.len() - start - HEADER_LEN;
    if len > MAX_FRAME_LEN {
        out.truncate(start);
        return Err(EncodeError::Oversize {
            len,
            max: MAX_FRAME_LEN,
        });
    }
    out[start..start + HEADER_LEN].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

/// One frame as a fresh buffer.
pub fn encode_to_vec(msg: &Message) -> Result<Vec<u8>, EncodeError> {
    let mut v = Vec::new();
    encode(msg, &mut v)?;
    Ok(v)
}

/// An event frame encoded once for every guest it goes to. Only the sequence number differs
/// between guests, and postcard writes it right after the message tag, so everything behind it
/// (host timestamps, kind, payload) is encoded here once and [`write_frame`](Self::write_frame)
/// prepends the per-guest part. The bytes are exactly those of [`encode`] on the equivalent
/// [`Message::Event`].
///
/// Cloning shares the bytes: one event routed to several guests is held once by all their
/// spools. The bytes are one allocation, made by the thread that encodes and freed by the one
/// that sends when the guest acknowledges; a busy host pushes on one thread while the stream
/// acknowledges on another, and every extra allocation per event would be one more free
/// contending for the pusher's malloc arena.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedEvent {
    host_realtime_ns: i64,
    /// postcard of `(host_realtime_ns, host_monotonic_ns, kind, payload)`.
    tail: Arc<[u8]>,
}

/// postcard's tag of [`Message::Event`] (variant index 3, a one-byte varint).
const EVENT_TAG: u8 = 3;

impl EncodedEvent {
    /// Memory it holds (for byte bounds).
    pub fn heap_bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.tail.len()
    }

    pub fn new(
        host_realtime_ns: i64,
        host_monotonic_ns: u64,
        kind: u16,
        payload: &[u8],
    ) -> Result<Self, EncodeError> {
        // Two varints of at most 10 bytes and one of at most 3.
        let mut head = [0u8; 23];
        let head = postcard::to_slice(&(host_realtime_ns, host_monotonic_ns, kind), &mut head)?;
        let mut len_bytes = [0u8; 10];
        let n = varint(payload.len() as u64, &mut len_bytes);
        let len_bytes = &len_bytes[..n];
        // The smallest frame it can make (sequence number 0) must fit.
        let len = 2 + head.len() + len_bytes.len() + payload.len();
        if len > MAX_FRAME_LEN {
            return Err(EncodeError::Oversize {
                len,
                max: MAX_FRAME_LEN,
            });
        }
        // A chain of slices has an exact length, so the Arc is allocated once, at its size.
        let tail = head
            .iter()
            .chain(len_bytes)
            .chain(payload)
            .copied()
            .collect::<Arc<[u8]>>();
        Ok(EncodedEvent {
            host_realtime_ns,
            tail,
        })
    }

    pub fn host_realtime_ns(&self) -> i64 {
        self.host_realtime_ns
    }

    /// Bytes of the frame (prefix included) with sequence number `seq`, or why it cannot be
    /// sent.
    pub fn frame_len(&self, seq: u64) -> Result<usize, EncodeError> {
        let len = 1 + varint(seq, &mut [0; 10]) + self.tail.len();
        if len > MAX_FRAME_LEN {
            return Err(EncodeError::Oversize {
                len,
                max: MAX_FRAME_LEN,
            });
        }
        Ok(HEADER_LEN + len)
    }

    /// Appends the frame (prefix + body) of this event with sequence number `seq` to `out`.
    /// On error `out` is left unchanged.
    pub fn write_frame(&self, seq: u64, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let len = self.frame_len(seq)? - HEADER_LEN;
        let mut head = [0u8; HEADER_LEN + 1 + 10];
        head[HEADER_LEN] = EVENT_TAG;
        let n = varint(seq, &mut head[HEADER_LEN + 1..]);
        head[..HEADER_LEN].copy_from_slice(&(len as u32).to_le_bytes());
        out.reserve(HEADER_LEN + len);
        out.extend_from_slice(&head[..HEADER_LEN + 1 + n]);
        out.extend_from_slice(&self.tail);
        Ok(())
    }
}

/// LEB128 of `v` into `out` (at least 10 bytes); returns the bytes used.
fn varint(mut v: u64, out: &mut [u8]) -> usize {
    let mut i = 0;
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out[i] = b;
            return i + 1;
        }
        out[i] = b | 0x80;
        i += 1;
    }
}

/// Incremental decoder for a byte stream of frames. Feed bytes with [`push`](Self::push), take
/// messages with [`next_frame`](Self::next_frame), call [`finish`](Self::finish) at end of
/// stream to detect a truncated last frame.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    pos: usize,
    max: usize,
    failed: Option<DecodeError>,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new(MAX_FRAME_LEN)
    }
}

impl FrameDecoder {
    /// A decoder accepting bodies of at most `max` bytes (`max` is itself capped at
    /// [`MAX_FRAME_LEN`]).
    pub fn new(max: usize) -> Self {
        FrameDecoder {
            buf: Vec::new(),
            pos: 0,
            max: max.min(MAX_FRAME_LEN),
            failed: None,
        }
    }

    /// Appends received bytes.
    pub fn push(&mut self, data: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        if self.pos > 0 && (self.pos == self.buf.len() || self.pos >= 64 * 1024) {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(data);
    }

    /// Bytes received but not yet consumed.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The next complete message, `Ok(None)` when more bytes are needed. A
    /// [`DecodeError::Garbage`] consumes the bad frame and decoding may go on; after a fatal
    /// error every call returns that error again.
    pub fn next_frame(&mut self) -> Result<Option<Message>, DecodeError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let avail = &self.buf[self.pos..];
        if avail.len() < HEADER_LEN {
            return Ok(None);
        }
        let len = u32::from_le_bytes([avail[0], avail[1], avail[2], avail[3]]) as usize;
        if len > self.max {
            let e = DecodeError::Oversize { len, max: self.max };
            self.failed = Some(e.clone());
            return Err(e);
        }
        if avail.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let body = &avail[HEADER_LEN..HEADER_LEN + len];
        self.pos += HEADER_LEN + len;
        decode_body(body).map(Some)
    }

    /// End of stream: an error if a partial frame is left over.
    pub fn finish(&self) -> Result<(), DecodeError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let have = self.buffered();
        if have == 0 {
            return Ok(());
        }
        let need = if have >= HEADER_LEN {
            let a = &self.buf[self.pos..];
            HEADER_LEN + u32::from_le_bytes([a[0], a[1], a[2], a[3]]) as usize
        } else {
            HEADER_LEN
        };
        Err(DecodeError::Truncated { need, have })
    }
}

/// Decodes exactly one frame from the start of `input`, returning the message and the bytes
/// consumed. Incomplete input is [`DecodeError::Truncated`]. Used by the fuzz target.
pub fn decode_one(input: &[u8]) -> Result<(Message, usize), DecodeError> {
    if input.len() < HEADER_LEN {
        return Err(DecodeError::Truncated {
            need: HEADER_LEN,
            have: input.len(),
        });
    }
    let len = u32::from_le_bytes([input[0], input[1], input[2], input[3]]) as usize;
    if len > MAX_FRAME_LEN {
        return Err(DecodeError::Oversize {
            len,
            max: MAX_FRAME_LEN,
        });
    }
    if input.len() < HEADER_LEN + len {
        return Err(DecodeError::Truncated {
            need: HEADER_LEN + len,
            have: input.len(),
        });
    }
    let msg = decode_body(&input[HEADER_LEN..HEADER_LEN + len])?;
    Ok((msg, HEADER_LEN + len))
}

fn decode_body(body: &[u8]) -> Result<Message, DecodeError> {
    match postcard::take_from_bytes::<Message>(body) {
        Ok((msg, [])) => Ok(msg),
        Ok((_, rest)) => Err(DecodeError::Garbage {
            len: body.len(),
            detail: format!("{} trailing bytes", rest.len()),
        }),
        Err(e) => Err(DecodeError::Garbage {
            len: body.len(),
            detail: e.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use super::*;

    fn ev(seq: u64, payload: Vec<u8>) -> Message {
        Message::Event(EventFrame {
            seq,
            host_realtime_ns: 1_700_000_000_000_000_000i64.wrapping_add(seq as i64),
            host_monotonic_ns: seq.wrapping_add(5_000),
            kind: 3,
            payload,
        })
    }

    #[test]
    fn roundtrip_all_messages_byte_by_byte() {
        let msgs = vec![
            Message::Hello(Hello {
                protocol_version: 1,
                host_id: "pve1".into(),
                boot_id: u64::MAX,
                capabilities: caps::ALL,
            }),
            Message::Welcome(Welcome {
                protocol_version: 1,
                resume_from: Some(42),
                capabilities: caps::ALL,
            }),
            Message::Reject(Reject {
                reason: "nope".into(),
            }),
            ev(7, vec![1, 2, 3]),
            ev(u64::MAX, vec![]),
            Message::SpoolLoss(SpoolLoss {
                dropped: 10,
                first_seq: 1,
                last_seq: 10,
            }),
            Message::Ack(Ack { up_to: 99 }),
            Message::ClockProbe(ClockProbe { id: 1, t1: -5 }),
            Message::ClockReply(ClockReply {
                id: 1,
                t1: -5,
                t2: i64::MAX,
                t3: i64::MIN,
            }),
        ];
        let mut wire = Vec::new();
        for m in &msgs {
            encode(m, &mut wire).unwrap();
        }
        let mut d = FrameDecoder::default();
        let mut out = Vec::new();
        for b in &wire {
            d.push(std::slice::from_ref(b));
            while let Some(m) = d.next_frame().unwrap() {
                out.push(m);
            }
        }
        assert_eq!(out, msgs);
        d.finish().unwrap();
    }

    #[test]
    fn payload_bytes_match_seq_encoding() {
        // The fast bytes path must stay wire compatible with a plain Vec<u8> sequence.
        #[derive(serde::Serialize)]
        struct Plain {
            v: Vec<u8>,
        }
        let a = postcard::to_allocvec(&Plain { v: vec![9; 300] }).unwrap();
        let frame = EventFrame {
            seq: 0,
            host_realtime_ns: 0,
            host_monotonic_ns: 0,
            kind: 0,
            payload: vec![9; 300],
        };
        let b = postcard::to_allocvec(&frame).unwrap();
        assert_eq!(&b[b.len() - a.len()..], &a[..]);
    }

    #[test]
    fn oversize_is_rejected_on_both_sides() {
        let big = ev(1, vec![0; MAX_FRAME_LEN]);
        assert!(matches!(
            encode_to_vec(&big),
            Err(EncodeError::Oversize { .. })
        ));
        let mut d = FrameDecoder::default();
        d.push(&((MAX_FRAME_LEN as u32) + 1).to_le_bytes());
        let e = d.next_frame().unwrap_err();
        assert_eq!(e.reason(), "oversize");
        assert!(e.is_fatal());
        // Stays failed.
        d.push(&encode_to_vec(&ev(1, vec![])).unwrap());
        assert_eq!(d.next_frame().unwrap_err().reason(), "oversize");
    }

    #[test]
    fn garbage_frame_is_skipped() {
        let mut wire = vec![3, 0, 0, 0, 0xff, 0xff, 0xff];
        wire.extend(encode_to_vec(&ev(5, vec![1])).unwrap());
        // Empty body.
        wire.extend([0, 0, 0, 0]);
        // Valid message followed by trailing junk inside the frame.
        let mut good = encode_to_vec(&Message::Ack(Ack { up_to: 3 })).unwrap();
        good.push(0);
        let l = (good.len() - HEADER_LEN) as u32;
        good[..4].copy_from_slice(&l.to_le_bytes());
        wire.extend(good);
        let mut d = FrameDecoder::default();
        d.push(&wire);
        assert_eq!(d.next_frame().unwrap_err().reason(), "garbage");
        assert_eq!(d.next_frame().unwrap(), Some(ev(5, vec![1])));
        assert_eq!(d.next_frame().unwrap_err().reason(), "garbage");
        let e = d.next_frame().unwrap_err();
        assert!(
            matches!(e, DecodeError::Garbage { ref detail, .. } if detail.contains("trailing"))
        );
        assert_eq!(d.next_frame().unwrap(), None);
        d.finish().unwrap();
    }

    #[test]
    fn truncated_detected_at_finish() {
        let wire = encode_to_vec(&ev(5, vec![1, 2, 3, 4])).unwrap();
        for cut in 1..wire.len() {
            let mut d = FrameDecoder::default();
            d.push(&wire[..cut]);
            assert_eq!(d.next_frame().unwrap(), None);
            let e = d.finish().unwrap_err();
            assert_eq!(e.reason(), "truncated", "cut {cut}");
            assert!(matches!(
                decode_one(&wire[..cut]),
                Err(DecodeError::Truncated { .. })
            ));
        }
        let (m, n) = decode_one(&wire).unwrap();
        assert_eq!(n, wire.len());
        assert_eq!(m, ev(5, vec![1, 2, 3, 4]));
    }

    #[test]
    fn encoded_event_is_byte_identical_to_encode() {
        let seqs = [0, 1, 127, 128, 300, 1 << 35, u64::MAX];
        let payloads = [vec![], vec![7], vec![1; 127], vec![2; 128], vec![3; 20_000]];
        for (i, p) in payloads.iter().enumerate() {
            let (rt, mono, kind) = (
                -5 - i as i64 * 1_000_000_007,
                u64::MAX - i as u64,
                i as u16 * 300,
            );
            let e = EncodedEvent::new(rt, mono, kind, p).unwrap();
            assert_eq!(e.host_realtime_ns(), rt);
            for seq in seqs {
                let msg = Message::Event(EventFrame {
                    seq,
                    host_realtime_ns: rt,
                    host_monotonic_ns: mono,
                    kind,
                    payload: p.clone(),
                });
                let mut out = vec![0xee];
                e.write_frame(seq, &mut out).unwrap();
                assert_eq!(out[1..], encode_to_vec(&msg).unwrap()[..], "seq {seq}");
            }
        }
    }

    #[test]
    fn encoded_event_respects_the_frame_limit_like_encode() {
        // Around the largest payload that fits, for short and long sequence numbers.
        let fits = |p: usize, seq: u64| {
            let msg = Message::Event(EventFrame {
                seq,
                host_realtime_ns: 0,
                host_monotonic_ns: 0,
                kind: 0,
                payload: vec![0; p],
            });
            let plain = encode_to_vec(&msg).is_ok();
            let mut out = Vec::new();
            let once =
                EncodedEvent::new(0, 0, 0, &vec![0; p]).and_then(|e| e.write_frame(seq, &mut out));
            assert_eq!(plain, once.is_ok(), "payload {p} seq {seq}");
            if once.is_err() {
                assert!(out.is_empty());
            }
            plain
        };
        let mut edge = None;
        for p in MAX_FRAME_LEN - 40..MAX_FRAME_LEN {
            for seq in [0, 1 << 40, u64::MAX] {
                if !fits(p, seq) && seq == 0 && edge.is_none() {
                    edge = Some(p);
                }
            }
        }
        assert!(edge.is_some());
    }
}
