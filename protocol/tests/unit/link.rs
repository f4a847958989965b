//! The stage links (`src/link.rs`): a link error keeps the transport's error and names both
//! ends; a missing link is a typed protocol error.

use std::time::Duration;

use k3_protocol::failure::{FailureKind, StageFailure};
use k3_protocol::link::*;
use k3_protocol::messages::{Msg, Stage};
use k3_protocol::transport::{InProcTransport, Transport, TransportError};

/// The orchestrator and the stages match the transport error through a `LinkError`;
/// the message keeps the wording the link had when it was text.
#[test]
fn link_errors_keep_the_transport_error_and_name_both_ends() {
    let (mut a, _b) = InProcTransport::pair(link_ring()).unwrap();
    let t = Some(Duration::from_millis(5));
    let e = recv_from(&mut a, Stage::TrunkLoader, Stage::LayerCompute, t).unwrap_err();
    assert_eq!(e.source, TransportError::Timeout);
    assert_eq!(
        (e.me, e.peer, e.op),
        (Stage::TrunkLoader, Stage::LayerCompute, LinkOp::Recv)
    );
    assert!(!e.peer_gone());
    assert_eq!(
        e.to_string(),
        "trunk-loader: layer-compute stopped answering (nothing for 0 s)"
    );
    let big = Msg::Text {
        bytes: vec![7; a.max_message() + 1],
    };
    let e = send_to(&mut a, Stage::Tokenizer, Stage::LayerCompute, &big, t).unwrap_err();
    assert!(matches!(e.source, TransportError::TooLarge { .. }));
    assert_eq!(e.op, LinkOp::Send);
    assert!(e
        .to_string()
        .starts_with("tokenizer: sending to layer-compute: message of "));
    let dead = LinkError {
        source: TransportError::PeerDied("killed".into()),
        ..e
    };
    assert!(dead.peer_gone());
    let f = StageFailure::from(dead.clone());
    assert_eq!(
        (f.kind, f.peer),
        (FailureKind::PeerDied, Some(Stage::LayerCompute))
    );
    assert_eq!(
        dead.to_string(),
        "tokenizer: sending to layer-compute: the peer died: killed"
    );
}

#[test]
fn a_missing_link_is_a_typed_protocol_error() {
    let (mine, theirs) = k3_protocol::control::pair().unwrap();
    let mut ctx = StageCtx::connect(Stage::Tokenizer, mine).unwrap();
    let e = match ctx.take_link(Stage::LayerCompute) {
        Err(e) => e,
        Ok(_) => panic!("no link was configured"),
    };
    assert!(matches!(
        e,
        ProtocolError::NoLink {
            stage: Stage::Tokenizer,
            peer: Stage::LayerCompute
        }
    ));
    assert_eq!(
        e.to_string(),
        "tokenizer: no link to layer-compute was configured"
    );
    drop(theirs);
}
