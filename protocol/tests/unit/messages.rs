//! The wire messages (`src/messages.rs`): every kind round-trips, stage names too, trailing
//! and truncated bytes are refused.

use k3_model::tensor::Dtype;
use k3_protocol::messages::*;
use k3_protocol::shm::Handle;

fn h() -> Handle {
    Handle {
        region: 3,
        offset: 4096,
        len: 17_547_264,
        generation: 9,
    }
}

#[test]
fn round_trip_every_kind() {
    let msgs = vec![
        Msg::Hello {
            stage: Stage::ExpertFetcher,
            pid: 42,
            version: PROTOCOL_VERSION,
        },
        Msg::Region {
            id: 5,
            role: RegionRole::Link {
                peer: Stage::LayerCompute,
                side: k3_protocol::transport::Side::B,
                peer_pid: 7,
            },
        },
        Msg::EncodeChat {
            req: 1,
            chat_json: "[{\"role\":\"user\"}]".into(),
        },
        Msg::Ids {
            req: 1,
            ids: vec![0, 163_839, u32::MAX],
        },
        Msg::Text {
            bytes: vec![0xe4, 0xbd],
        },
        Msg::LayerReady {
            pass: 2,
            layer: 92,
            handle: h(),
            tensors: vec![TensorSpan {
                name: "model.layers.92.mlp.gate".into(),
                dtype: Dtype::BF16,
                shape: vec![896, 7168],
                handle: h(),
            }],
        },
        Msg::Experts {
            pass: 2,
            layer: 3,
            ids: (0..16).collect(),
        },
        Msg::ExpertFailed {
            pass: 2,
            layer: 3,
            id: 895,
            error: "short read".into(),
        },
        Msg::StepStats(StepStats {
            step: 1,
            token: 77,
            seconds: 0.25,
            ..Default::default()
        }),
        Msg::Shutdown,
        Msg::Error {
            stage: Stage::TrunkLoader,
            failure: k3_protocol::failure::StageFailure::new(
                k3_protocol::failure::FailureKind::PeerDied,
                "trunk-loader: sending to layer-compute: the peer died: killed",
            )
            .with_peer(Stage::LayerCompute),
        },
        Msg::Generate(GenRequest {
            req: 3,
            prompt: vec![1, 2, 163_839],
            gen: 16,
            sampler: k3_protocol::conf::SamplerConfig {
                temperature: Some(0.7),
                seed: 9,
                ..Default::default()
            },
            stop_ids: vec![163_586],
            snapshot_at: Some(2),
            cache_entries: 8,
            keep_logits: true,
        }),
        Msg::RequestStarted {
            req: 3,
            cached_tokens: 2,
        },
        Msg::StopRequest { req: 3 },
        Msg::Progress {
            stage: Stage::TrunkLoader,
            phase: "load".into(),
            done: 1 << 30,
            total: 3 << 30,
        },
        Msg::RequestDone {
            req: 3,
            generated: vec![5, 6],
        },
        Msg::SaveState {
            req: 4,
            path: "/tmp/chat.json.state".into(),
            fingerprint: "ab12".into(),
            tokens: vec![1, 2, 3],
        },
        Msg::LoadState {
            req: 5,
            path: "chat.json.state".into(),
            fingerprint: "ab12".into(),
            tokens: vec![1, 2, 3],
            cache_entries: 8,
        },
        Msg::StateDone {
            req: 5,
            tokens: 2,
            error: Some("the state was saved for another model".into()),
        },
        Msg::Token(TokenMsg {
            req: 4,
            index: 2,
            token: 163_839,
            expert_failures: 1,
            logits: Some(vec![0.5, f32::MIN_POSITIVE, -3.25]),
        }),
        Msg::PassStats(PassStats {
            rows: 9,
            decode_rows: 3,
            prefill_rows: 6,
            busy: 4,
            queued: 2,
            seconds: 0.125,
            expert_requests: 40,
            resident_hits: 31,
            ..Default::default()
        }),
        Msg::Guess {
            pass: 4,
            layer: 2,
            experts: vec![0, 7, 895],
        },
        Msg::RequestFailed {
            req: 4,
            error: "generation step 3: the logits are not finite".into(),
        },
    ];
    for m in msgs {
        let b = encode(&m).unwrap();
        assert_eq!(decode(&b).unwrap(), m);
    }
}

#[test]
fn trailing_and_truncated_bytes_are_refused() {
    let mut b = encode(&Msg::Ping { nonce: 300 }).unwrap();
    // A decoder that ignored the consumed count would accept this.
    b.push(0);
    assert!(matches!(
        decode(&b),
        Err(CodecError::Trailing { trailing: 1, .. })
    ));
    let b = encode(&Msg::Ids {
        req: 1,
        ids: vec![1, 2, 3],
    })
    .unwrap();
    assert!(decode(&b[..b.len() - 1]).is_err());
    // A huge claimed length must not allocate: the limit refuses it.
    let mut evil = encode(&Msg::Text { bytes: vec![] }).unwrap();
    evil.pop();
    evil.extend_from_slice(&[0xfc, 0xff, 0xff, 0xff, 0x7f]);
    assert!(decode(&evil).is_err());
}

#[test]
fn stage_names_round_trip() {
    for s in Stage::WORKERS {
        assert_eq!(Stage::parse(s.name()), Some(s));
    }
    assert_eq!(Stage::parse("compute"), None);
}
