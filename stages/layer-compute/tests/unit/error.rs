//! The compute stage's failures (`src/error.rs`) as the orchestrator matches them: each
//! one's own kind, a dead peer named.

use k3_layer_compute::decode::DecodeError;
use k3_layer_compute::error::*;
use k3_layer_compute::forward::ForwardError;
use k3_layer_compute::state::StateError;
use k3_model::tensor::WeightError;
use k3_protocol::control::ControlError;
use k3_protocol::failure::{FailureKind, StageFailure};
use k3_protocol::link::{LinkError, LinkOp};
use k3_protocol::messages::Stage;
use k3_protocol::transport::TransportError;

fn link(source: TransportError) -> LinkError {
    LinkError {
        me: Stage::LayerCompute,
        peer: Stage::TrunkLoader,
        op: LinkOp::Recv,
        timeout: None,
        source,
    }
}

// Catches a link failure reported as the forward pass's (the orchestrator would blame
// layer-compute for the trunk-loader's death), or a peer that is not named.
#[test]
fn a_dead_peer_is_reported_as_its_death_naming_it() {
    let e = ComputeError::from(DecodeError::Hook(PeerError::Link(link(
        TransportError::PeerDied("pid 7".into()),
    ))));
    let f = StageFailure::from(e);
    assert_eq!(f.kind, FailureKind::PeerDied);
    assert_eq!(f.peer, Some(Stage::TrunkLoader));
    assert!(f.detail.starts_with("layer-compute: link to trunk-loader"));
    let f = StageFailure::from(ComputeError::from(link(TransportError::Timeout)));
    assert_eq!(
        (f.kind, f.peer),
        (FailureKind::Timeout, Some(Stage::TrunkLoader))
    );
}

// Catches every compute failure reported as one kind (Forward, as the text-only stage
// did): a missing tensor is a bind failure, a NaN row a forward failure, a closed
// control socket the orchestrator's death.
#[test]
fn each_failure_reports_its_own_kind() {
    let bind = ForwardError::Bind(WeightError::Missing("x".into()));
    let f = StageFailure::from(ComputeError::from(DecodeError::<PeerError>::Forward {
        step: 3,
        source: bind,
    }));
    assert_eq!(f.kind, FailureKind::Bind);
    assert!(f.detail.contains("step 3"), "{}", f.detail);
    let nan = ForwardError::NonFinite("layer 0".into());
    assert_eq!(
        StageFailure::from(ComputeError::Forward(nan)).kind,
        FailureKind::Forward
    );
    let f = StageFailure::from(ComputeError::from(ControlError::Closed));
    assert_eq!(
        (f.kind, f.peer),
        (FailureKind::PeerDied, Some(Stage::Orchestrator))
    );
    let f = StageFailure::from(ComputeError::NoRegion { name: "trunk" });
    assert_eq!(f.kind, FailureKind::Protocol);
    let f = StageFailure::from(ComputeError::State(StateError::Checksum));
    assert_eq!(f.kind, FailureKind::Config);
}
