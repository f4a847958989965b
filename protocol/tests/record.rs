//! The recording format: write/read round trip, the transport wrapper, and detection of a
//! modified, truncated or reordered log.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k3_protocol::messages::{self, Msg};
use k3_protocol::record::{
    self, read_recording, Entry, RecordError, Recorder, RecordingTransport, ReplayTransport,
};
use k3_protocol::ring::RingConfig;
use k3_protocol::shm::Handle;
use k3_protocol::transport::{InProcTransport, Transport, TransportError};

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("k3-record-test-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn sample(dir: &std::path::Path, keep: bool) -> (PathBuf, Vec<Entry>) {
    let mut r = Recorder::create(dir, "layer-compute", keep).unwrap();
    let m1 = messages::encode(&Msg::StartPass {
        pass: 1,
        start: 0,
        len: 5,
    })
    .unwrap();
    let m2 = messages::encode(&Msg::LayerDone { pass: 1, layer: 0 }).unwrap();
    let h = Handle {
        region: 3,
        offset: 64,
        len: 5,
        generation: 2,
    };
    r.inbound("orch", &m1).unwrap();
    r.buffer_read(&h, b"abcde").unwrap();
    r.outbound("trunk", &m2).unwrap();
    let path = r.finish().unwrap();
    let entries = vec![
        Entry::Inbound {
            channel: "orch".into(),
            frame: m1,
        },
        Entry::BufferRead {
            handle: h,
            sha256: record::sha256(b"abcde"),
            bytes: keep.then(|| b"abcde".to_vec()),
        },
        Entry::Outbound {
            channel: "trunk".into(),
            frame: m2,
        },
    ];
    (path, entries)
}

#[test]
fn round_trip_with_and_without_bytes() {
    for keep in [false, true] {
        let dir = tmpdir(&format!("rt{keep}"));
        let (path, want) = sample(&dir, keep);
        assert_eq!(path, dir.join("layer-compute.k3rec"));
        let rec = read_recording(&path, true).unwrap();
        assert_eq!(rec.stage, "layer-compute");
        assert_eq!(rec.bytes_kept, keep);
        assert!(rec.complete);
        assert_eq!(rec.entries, want);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Catches: a reader without integrity checks (every single-byte change after the header
/// must be reported, naming an entry), and one that silently accepts a truncated log as
/// complete.
#[test]
fn mutation_and_truncation_are_detected() {
    let dir = tmpdir("mut");
    let (path, want) = sample(&dir, true);
    let orig = std::fs::read(&path).unwrap();
    let header_len = 8 + 2 + "layer-compute".len() + 1;
    for i in header_len..orig.len() {
        let mut b = orig.clone();
        b[i] ^= 0x20;
        std::fs::write(&path, &b).unwrap();
        match read_recording(&path, true) {
            Err(RecordError::Integrity { .. }) | Err(RecordError::Malformed { .. }) => {}
            Ok(r) if !r.complete || r.entries != want => {}
            r => panic!("flipping byte {i} went unnoticed: {r:?}"),
        }
    }
    // Unverified reading still parses a payload mutation (for replay-failure tests).
    let mut b = orig.clone();
    let at = header_len + 5 + 1 + 4 + 1; // inside the first frame
    b[at] ^= 1;
    std::fs::write(&path, &b).unwrap();
    let r = read_recording(&path, false).unwrap();
    assert_ne!(r.entries[0], want[0]);
    assert_eq!(r.entries[1..], want[1..]);
    // Truncation: whole entries before the cut survive; the recording is marked incomplete.
    std::fs::write(&path, &orig[..orig.len() - 10]).unwrap();
    let r = read_recording(&path, true).unwrap();
    assert!(!r.complete);
    assert_eq!(r.entries, want);
    // Not a recording at all.
    std::fs::write(&path, b"hello world, not a log").unwrap();
    assert!(matches!(
        read_recording(&path, true),
        Err(RecordError::BadMagic { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn recording_transport_logs_both_directions() {
    let dir = tmpdir("wrap");
    let rec = Arc::new(Mutex::new(
        Recorder::create(&dir, "tokenizer", false).unwrap(),
    ));
    let (a, mut b) = InProcTransport::pair(RingConfig::new(16, 128)).unwrap();
    let mut a = RecordingTransport::new(a, "compute", rec.clone());
    let t = Some(Duration::from_secs(5));
    b.send(
        &Msg::EncodeText {
            req: 1,
            text: "hi".into(),
            allow_specials: false,
        },
        t,
    )
    .unwrap();
    let got = a.recv(t).unwrap();
    a.send(
        &Msg::Ids {
            req: 1,
            ids: vec![5, 6],
        },
        t,
    )
    .unwrap();
    assert_eq!(
        b.recv(t).unwrap(),
        Msg::Ids {
            req: 1,
            ids: vec![5, 6]
        }
    );
    drop(a);
    let rec = Arc::try_unwrap(rec).unwrap().into_inner().unwrap();
    let path = rec.finish().unwrap();
    let r = read_recording(&path, true).unwrap();
    assert_eq!(
        r.entries,
        vec![
            Entry::Inbound {
                channel: "compute".into(),
                frame: messages::encode(&got).unwrap()
            },
            Entry::Outbound {
                channel: "compute".into(),
                frame: messages::encode(&Msg::Ids {
                    req: 1,
                    ids: vec![5, 6]
                })
                .unwrap()
            },
        ]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A toy stage: answers each `EncodeText` with the byte values of the text as ids, until
/// `Shutdown`.
fn toy_stage(t: &mut dyn Transport) -> Result<(), TransportError> {
    loop {
        match t.recv(None) {
            Ok(Msg::EncodeText { req, text, .. }) => t.send(
                &Msg::Ids {
                    req,
                    ids: text.bytes().map(u32::from).collect(),
                },
                None,
            )?,
            Ok(Msg::Shutdown) => return Ok(()),
            Ok(m) => panic!("toy stage got {m:?}"),
            Err(e) => return Err(e),
        }
    }
}

/// Record a toy stage, replay it: same outputs pass; a mutated recorded inbound message (read
/// without the integrity check) makes the replay fail at the comparison. Catches: a replay
/// that does not compare outbound bytes, or stops comparing after the first frame.
#[test]
fn replay_matches_and_detects_a_mutated_message() {
    let dir = tmpdir("replay");
    let rec = Arc::new(Mutex::new(
        Recorder::create(&dir, "tokenizer", false).unwrap(),
    ));
    let (a, mut b) = InProcTransport::pair(RingConfig::new(16, 128)).unwrap();
    let mut a = RecordingTransport::new(a, "compute", rec.clone());
    let t = Some(Duration::from_secs(5));
    for (i, s) in ["hello", "k3", "replay me"].iter().enumerate() {
        b.send(
            &Msg::EncodeText {
                req: i as u64,
                text: s.to_string(),
                allow_specials: false,
            },
            t,
        )
        .unwrap();
    }
    b.send(&Msg::Shutdown, t).unwrap();
    toy_stage(&mut a).unwrap();
    for i in 0..3 {
        assert!(matches!(b.recv(t).unwrap(), Msg::Ids { req, .. } if req == i));
    }
    drop(a);
    let path = Arc::try_unwrap(rec)
        .unwrap()
        .into_inner()
        .unwrap()
        .finish()
        .unwrap();

    let r = read_recording(&path, true).unwrap();
    assert_eq!(r.channels(), vec!["compute".to_string()]);
    let mut replay = ReplayTransport::new(&r, "compute");
    toy_stage(&mut replay).unwrap();
    replay.finish().unwrap();

    // Mutate one byte of the last inbound text ("replay me" -> "replay mf"), then replay
    // from the unverified log: the stage's answer differs and the replay says where.
    let mut bytes = std::fs::read(&path).unwrap();
    let pos = bytes.windows(9).rposition(|w| w == b"replay me").unwrap();
    bytes[pos + 8] ^= 3;
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        read_recording(&path, true),
        Err(RecordError::Integrity { .. })
    ));
    let r = read_recording(&path, false).unwrap();
    let mut replay = ReplayTransport::new(&r, "compute");
    match toy_stage(&mut replay) {
        Err(TransportError::Replay(msg)) => {
            assert!(msg.contains("outbound frame 2 differs"), "{msg}")
        }
        other => panic!("mutated replay: {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
