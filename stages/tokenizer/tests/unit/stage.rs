//! The tokenizer stage (`src/stage.rs`): each failure carries its kind.

use k3_protocol::failure::{FailureKind, StageFailure};
use k3_protocol::link::LinkError;
use k3_protocol::link::LinkOp;
use k3_protocol::messages::Stage;
use k3_protocol::transport::TransportError;
use k3_tokenizer::stage::*;

/// The orchestrator reads the kind, never the text: each failure maps to its kind, and
/// a link failure keeps the peer it is about.
#[test]
fn failures_carry_their_kind() {
    let f = StageFailure::from(TokenizerStageError::ChatNeedsKimi);
    assert_eq!(f.kind, FailureKind::Config);
    assert_eq!(f.detail, "tokenizer: --chat needs a Kimi tokenizer (--tok)");
    let f = StageFailure::from(TokenizerStageError::Unexpected("Shutdown".into()));
    assert_eq!(f.kind, FailureKind::Protocol);
    let link = LinkError {
        me: Stage::Tokenizer,
        peer: Stage::LayerCompute,
        op: LinkOp::Recv,
        timeout: None,
        source: TransportError::PeerDied("killed".into()),
    };
    let f = StageFailure::from(TokenizerStageError::from(link));
    assert_eq!(
        (f.kind, f.peer),
        (FailureKind::PeerDied, Some(Stage::LayerCompute))
    );
    assert_eq!(
        f.detail,
        "tokenizer: link to layer-compute: the peer died: killed"
    );
}
