//! The `Weights` conformance suite (stages/layer-compute/tests/conformance/mod.rs) against
//! `StagedWeights`: the real trunk-loader and expert-fetcher stage loops run in threads,
//! wired by this test the way k3-orch wires them (control sockets, two-ring link regions,
//! `Configure`, their arenas handed to compute as shared-memory regions), and compute's side
//! is a `StagedWeights` over the links. Resident and streamed trunks, both tiny models.

#[path = "../../stages/layer-compute/tests/conformance/mod.rs"]
mod conformance;

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use k3_layer_compute::links::{LoaderLinks, StagedWeights};
use k3_model::config::ModelConfig;
use k3_model::mmap_weights::MmapWeights;
use k3_protocol::conf::{FetcherConf, TrunkConf};
use k3_protocol::control::{self, ControlSocket};
use k3_protocol::link::{link_ring, Rec, StageCtx};
use k3_protocol::messages::{Msg, RegionRole, Stage};
use k3_protocol::transport::{ShmTransport, Side};

const T: Duration = Duration::from_secs(30);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Next message from a stage that is not a heartbeat.
fn recv(c: &ControlSocket) -> (Msg, Vec<OwnedFd>) {
    loop {
        match c.recv(Some(T)).expect("stage control message") {
            (Msg::Pong { .. } | Msg::Progress { .. }, _) => continue,
            (Msg::Error { stage, failure }, _) => panic!("{stage} failed: {failure}"),
            m => return m,
        }
    }
}

struct Stages {
    controls: Vec<ControlSocket>,
    threads: Vec<JoinHandle<Result<(), k3_protocol::failure::StageFailure>>>,
}

impl Stages {
    /// Read the stages' last frames (summaries) until their threads end.
    fn finish(self) {
        let deadline = Instant::now() + T;
        while self.threads.iter().any(|h| !h.is_finished()) {
            assert!(Instant::now() < deadline, "stages did not finish");
            for c in &self.controls {
                let _ = c.recv(Some(Duration::from_millis(20)));
            }
        }
        for h in self.threads {
            h.join().expect("stage thread").expect("stage result");
        }
    }
}

/// Start trunk-loader and expert-fetcher, wire them to a compute context; returns the
/// compute-side weights.
fn staged(model: &Path, trunk_dir: Option<PathBuf>, layers: usize) -> (StagedWeights, Stages) {
    let mut controls = Vec::new();
    let mut threads = Vec::new();
    for stage in [Stage::TrunkLoader, Stage::ExpertFetcher] {
        let (ours, theirs) = control::pair().unwrap();
        threads.push(std::thread::spawn(move || {
            let ctx = StageCtx::connect(stage, theirs)?;
            match stage {
                Stage::TrunkLoader => k3_trunk_loader::stage::run(ctx),
                _ => k3_expert_fetcher::stage::run(ctx),
            }
        }));
        controls.push(ours);
    }
    let (c_ours, c_theirs) = control::pair().unwrap();
    let mut cctx = StageCtx::connect(Stage::LayerCompute, c_theirs).unwrap();
    for c in &controls {
        assert!(matches!(recv(c).0, Msg::Hello { .. }));
    }
    assert!(matches!(recv(&c_ours).0, Msg::Hello { .. }));
    for (i, (c, peer)) in controls
        .iter()
        .zip([Stage::TrunkLoader, Stage::ExpertFetcher])
        .enumerate()
    {
        let id = i as u32 + 1;
        let region =
            ShmTransport::create_region(id, &format!("link-{peer}"), &link_ring()).unwrap();
        let role = |peer, side| RegionRole::Link {
            peer,
            side,
            peer_pid: 0,
        };
        c_ours
            .send(
                &Msg::Region {
                    id,
                    role: role(peer, Side::A),
                },
                &[region.fd()],
            )
            .unwrap();
        c.send(
            &Msg::Region {
                id,
                role: role(Stage::LayerCompute, Side::B),
            },
            &[region.fd()],
        )
        .unwrap();
    }
    let trunk = TrunkConf {
        model_dir: model.to_path_buf(),
        trunk_dir,
        trunk_copies: Vec::new(),
        // Room for two layers: the rest streams through the ring.
        budget_bytes: 1 << 20,
        layers,
        record_dir: None,
        sink_bytes: 0,
        decode_weight_ppm: 0,
        hold_wrap: false,
        trunk_resident: Default::default(),
    };
    let fetcher = FetcherConf {
        model_dir: model.to_path_buf(),
        cache_bytes: 0,
        min_slots: 32,
        max_slots: 64,
        readers: 4,
        inject_failures: Vec::new(),
        inject_drive_failures: Vec::new(),
        experts_dirs: Vec::new(),
        trace_dir: None,
        record_dir: None,
    };
    for (c, json) in controls.iter().zip([
        serde_json::to_string(&trunk).unwrap(),
        serde_json::to_string(&fetcher).unwrap(),
    ]) {
        c.send(&Msg::Configure { json }, &[]).unwrap();
    }
    for c in &controls {
        let mut region = None;
        loop {
            match recv(c) {
                (
                    Msg::Region {
                        id,
                        role: RegionRole::Data { name },
                    },
                    mut fds,
                ) => region = Some((id, name, fds.pop().expect("region fd"))),
                (Msg::Ready { .. }, _) => break,
                (other, _) => panic!("unexpected {other:?} during set-up"),
            }
        }
        let (id, name, fd) = region.expect("a data region");
        c_ours
            .send(
                &Msg::Region {
                    id,
                    role: RegionRole::Data { name },
                },
                &[fd.as_fd()],
            )
            .unwrap();
    }
    c_ours
        .send(&Msg::Configure { json: "{}".into() }, &[])
        .unwrap();
    cctx.wait_configure().unwrap();
    for c in &controls {
        c.send(
            &Msg::Ready {
                stage: Stage::Orchestrator,
            },
            &[],
        )
        .unwrap();
    }
    let region = |name: &str| cctx.regions.get(cctx.data[name]).unwrap().clone();
    let (tr, er) = (region("trunk"), region("experts"));
    let links = LoaderLinks {
        trunk: cctx.take_link(Stage::TrunkLoader).unwrap(),
        trunk_region: tr,
        fetch: cctx.take_link(Stage::ExpertFetcher).unwrap(),
        expert_region: er,
    };
    let w = StagedWeights::new(
        MmapWeights::open(model).unwrap(),
        links,
        layers,
        Some(T),
        Rec::default(),
    );
    controls.push(c_ours);
    // Keep the compute context's heartbeat alive for the whole test.
    std::mem::forget(cctx);
    (w, Stages { controls, threads })
}

fn run(model: &str, packed: bool) {
    let dir = root().join("tests/fixtures").join(model).join("sharded");
    let cfg = ModelConfig::load_dir(&dir).unwrap();
    let layers = cfg.n_layers();
    let tmp = tempfile::tempdir().unwrap();
    let trunk_dir = packed.then(|| {
        let out = tmp.path().join("trunk");
        let st = std::process::Command::new(env!("CARGO_BIN_EXE_k3-orch"))
            .args(["pack-trunk"])
            .arg(&dir)
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            st.status.success(),
            "{}",
            String::from_utf8_lossy(&st.stderr)
        );
        out
    });
    let src = MmapWeights::open(&dir).unwrap();
    let (w, stages) = staged(&dir, trunk_dir, layers);
    conformance::check_pass(&w, &src, &cfg, layers);
    conformance::check_pass(&w, &src, &cfg, layers);
    let oracle: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            root()
                .join("tests/fixtures")
                .join(model)
                .join("expected-k3ref.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let ids = |k: &str| -> Vec<u32> {
        oracle[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let (prompt, full) = (ids("prompt_ids"), ids("full_ids"));
    let got = conformance::greedy_ids(&w, &cfg, &prompt, full.len() - prompt.len());
    assert_eq!(
        got,
        &full[prompt.len()..],
        "{model}: ids vs k3ref through the stages"
    );
    w.shutdown().unwrap();
    stages.finish();
}

#[test]
fn staged_weights_conform_resident_trunk() {
    run("tiny-mxfp4", false);
    run("tiny-seed", false);
}

#[test]
fn staged_weights_conform_streamed_trunk() {
    run("tiny-mxfp4", true);
}
