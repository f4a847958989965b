//! Driving a started pipeline: wire the stages (links, regions, `Configure`), encode the
//! prompt, then relay generation (step statistics, text, summaries) until every stage is
//! done, turning an exit, an `Error` or silence into a [`RunError`] that names the stage.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use k3_protocol::messages::{Msg, RegionRole, Stage};
use k3_protocol::shm::Region;
use k3_protocol::transport::{ShmTransport, Side};

use super::spawn::{ExitCause, Exited, Running, StageEvent};
use super::{erased, Launch, Mode, Observer, Outcome};
use crate::error::RunError;

/// Wait for the next event, watching heartbeats; returns a failure for a silent stage.
pub(super) fn next_event(
    r: &mut Running,
    timeout: Duration,
    expect_alive: &[Stage],
) -> Result<StageEvent, RunError> {
    loop {
        if super::spawn::INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
            let code = super::spawn::interrupted_exit_code();
            return Err(RunError::new(
                code,
                format!(
                    "k3-orch: interrupted by {}; stages stopped",
                    super::spawn::signal_name(code - 128)
                ),
            ));
        }
        match r.events.recv_timeout(Duration::from_millis(100)) {
            Ok(ev) => {
                if let StageEvent::Control(s, Ok(_)) = &ev {
                    r.last_seen.insert(*s, Instant::now());
                }
                return Ok(ev);
            }
            Err(RecvTimeoutError::Timeout) => {
                let now = Instant::now();
                for s in expect_alive {
                    if r.exited.contains_key(s) {
                        continue;
                    }
                    let seen = *r.last_seen.entry(*s).or_insert(now);
                    if now.duration_since(seen) > timeout {
                        return Err(RunError::new(
                            1,
                            format!(
                                "k3-orch: stage {s} stopped answering (no heartbeat for {:.0} s); stopping the pipeline",
                                timeout.as_secs_f64()
                            ),
                        ));
                    }
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(RunError::new(1, "k3-orch: every stage connection is gone"))
            }
        }
    }
}

/// Turn an unexpected exit into a failure naming the stage and the cause.
pub(super) fn exit_failure(r: &Running, e: &Exited) -> RunError {
    let stage = e.stage.clone();
    let mut msg = format!("k3-orch: stage {stage} (pid {}) {}", e.pid, e.cause);
    if let Some(cg) = &r.cgroups {
        if let Some(s) = Stage::parse(&stage) {
            if let Some(limit) = cg.oom_killed(s) {
                msg = format!(
                    "k3-orch: stage {stage} (pid {}) was killed by the kernel OOM killer at its memory limit of {} ({})",
                    e.pid,
                    crate::units::human(limit),
                    e.cause
                );
            }
        }
    }
    if matches!(e.cause, ExitCause::Code(0)) {
        msg.push_str(" before the run was finished");
    }
    RunError::new(1, msg)
}

pub(super) fn handle_common(
    r: &mut Running,
    ev: StageEvent,
    phase: &str,
) -> Result<Option<(Stage, Msg, Vec<OwnedFd>)>, RunError> {
    match ev {
        StageEvent::Control(s, Ok((Msg::Pong { .. }, _))) => {
            let _ = s;
            Ok(None)
        }
        StageEvent::Control(
            _,
            Ok((
                Msg::Progress {
                    stage,
                    phase,
                    done,
                    total,
                },
                _,
            )),
        ) => {
            r.progress.update(stage, &phase, done, total);
            Ok(None)
        }
        StageEvent::Control(s, Ok((Msg::Error { stage, failure }, _))) => {
            let _ = s;
            Err(RunError::new(
                1,
                format!("k3-orch: stage {stage} failed: {failure}"),
            ))
        }
        StageEvent::Control(s, Ok((m, fds))) => Ok(Some((s, m, fds))),
        StageEvent::Control(s, Err(e)) => {
            // The control socket closed: the exit event (process mode) says why; give it a
            // moment to arrive.
            let deadline = Instant::now() + Duration::from_millis(500);
            while Instant::now() < deadline {
                if let Ok(StageEvent::Exit(x)) = r.events.recv_timeout(Duration::from_millis(50)) {
                    let f = exit_failure(r, &x);
                    r.exited.insert(s, x);
                    return Err(f);
                }
            }
            Err(RunError::new(
                1,
                format!("k3-orch: stage {s} closed its control socket {phase}: {e}"),
            ))
        }
        StageEvent::Exit(x) => {
            let f = exit_failure(r, &x);
            if let Some(s) = Stage::parse(&x.stage) {
                r.exited.insert(s, x);
            }
            Err(f)
        }
    }
}

fn link_region(id: u32, a: Stage, b: Stage) -> Result<Region, RunError> {
    ShmTransport::create_region(
        id,
        &format!("link-{a}-{b}"),
        &k3_protocol::link::link_ring(),
    )
    .map_err(|e| RunError::new(1, format!("k3-orch: link region {a}<->{b}: {e}")))
}

/// A data region a loader shared (id, name, fd), to pass on to compute.
pub(super) type DataRegion = (u32, String, OwnedFd);

/// Run the pipeline; on success the outcome, else a failure with its exit code. Stages are
/// always stopped and reaped before this returns.
pub(super) fn drive(
    launch: &Launch,
    r: &mut Running,
    obs: &mut dyn Observer,
) -> Result<Outcome, RunError> {
    let timeout = launch.stage_timeout;
    let all = Stage::WORKERS;
    let data = wire(launch, r)?;
    // 4. The prompt.
    let mut compute = launch.compute.clone();
    if let Some(req) = &launch.prompt {
        r.send(Stage::Tokenizer, req, &[])?;
        loop {
            let ev = next_event(r, timeout, &all)?;
            if let Some((s, m, _)) = handle_common(r, ev, "while encoding the prompt")? {
                match m {
                    Msg::Ids { ids, .. } if s == Stage::Tokenizer => {
                        compute.prompt_ids = ids;
                        break;
                    }
                    other => {
                        return Err(RunError::new(
                            1,
                            format!("k3-orch: {s} sent {other:?} while encoding"),
                        ))
                    }
                }
            }
        }
    }
    if compute.prompt_ids.is_empty() && compute.load_state.is_none() {
        return Err(RunError::new(2, "k3-orch: the prompt encodes to no tokens"));
    }
    if compute.prompt_ids.len() > k3_protocol::conf::MAX_PROMPT_IDS {
        return Err(RunError::new(
            2,
            format!(
                "k3-orch: the prompt is {} tokens, over the {}-token limit",
                compute.prompt_ids.len(),
                k3_protocol::conf::MAX_PROMPT_IDS
            ),
        ));
    }
    r.progress.set_prompt_tokens(compute.prompt_ids.len());
    if compute
        .prefill_chunk
        .is_some_and(|c| c < compute.prompt_ids.len())
    {
        r.progress.set_prefill_in_passes();
    }
    start_compute(launch, r, &compute, data)?;
    generate(launch, r, obs, compute.prompt_ids.clone())
}

/// Steps 1-3 of the wiring: every `Hello`, the links, `Configure` to the three servers;
/// returns the data regions they shared.
pub(super) fn wire(launch: &Launch, r: &mut Running) -> Result<Vec<DataRegion>, RunError> {
    let hello = await_hello(launch, r)?;
    send_links(launch, r, &hello)?;
    configure_servers(launch, r)
}

/// Step 1: `Hello` from every worker, in the protocol's version; their pids.
fn await_hello(launch: &Launch, r: &mut Running) -> Result<HashMap<Stage, u32>, RunError> {
    let all = Stage::WORKERS;
    let mut hello: HashMap<Stage, u32> = HashMap::new();
    while hello.len() < all.len() {
        let ev = next_event(r, launch.stage_timeout, &all)?;
        if let Some((s, m, _)) = handle_common(r, ev, "during start-up")? {
            match m {
                Msg::Hello {
                    stage,
                    pid,
                    version,
                } if stage == s => {
                    if version != k3_protocol::messages::PROTOCOL_VERSION {
                        return Err(RunError::new(
                            1,
                            format!("k3-orch: {s} speaks protocol {version}"),
                        ));
                    }
                    hello.insert(s, pid);
                }
                other => {
                    return Err(RunError::new(
                        1,
                        format!("k3-orch: {s} sent {other:?} before Hello"),
                    ))
                }
            }
        }
    }
    Ok(hello)
}

/// Step 2: the links, compute side A of each (a peer's pid only between processes).
fn send_links(
    launch: &Launch,
    r: &mut Running,
    hello: &HashMap<Stage, u32>,
) -> Result<(), RunError> {
    let peer_pid = |s: Stage| -> u32 {
        if launch.mode == Mode::Processes {
            hello[&s]
        } else {
            0
        }
    };
    for (link_id, peer) in
        (1u32..).zip([Stage::TrunkLoader, Stage::ExpertFetcher, Stage::Tokenizer])
    {
        let region = link_region(link_id, Stage::LayerCompute, peer)?;
        r.send(
            Stage::LayerCompute,
            &Msg::Region {
                id: link_id,
                role: RegionRole::Link {
                    peer,
                    side: Side::A,
                    peer_pid: peer_pid(peer),
                },
            },
            &[region.fd()],
        )?;
        r.send(
            peer,
            &Msg::Region {
                id: link_id,
                role: RegionRole::Link {
                    peer: Stage::LayerCompute,
                    side: Side::B,
                    peer_pid: peer_pid(Stage::LayerCompute),
                },
            },
            &[region.fd()],
        )?;
    }
    Ok(())
}

/// Step 3: `Configure` to the three servers; their data regions, until each is `Ready`.
fn configure_servers(launch: &Launch, r: &mut Running) -> Result<Vec<DataRegion>, RunError> {
    let servers: [(Stage, &dyn erased::Json); 3] = [
        (Stage::Tokenizer, &launch.tokenizer),
        (Stage::TrunkLoader, &launch.trunk),
        (Stage::ExpertFetcher, &launch.fetcher),
    ];
    for (stage, conf) in servers {
        r.send(stage, &Msg::Configure { json: conf.json() }, &[])?;
    }
    let all = Stage::WORKERS;
    let mut ready: Vec<Stage> = Vec::new();
    let mut data: Vec<DataRegion> = Vec::new();
    while ready.len() < 3 {
        let ev = next_event(r, launch.stage_timeout, &all)?;
        if let Some((s, m, mut fds)) = handle_common(r, ev, "during set-up")? {
            match m {
                Msg::Ready { stage } if stage == s => ready.push(s),
                Msg::Region {
                    id,
                    role: RegionRole::Data { name },
                } => {
                    let fd = fds.pop().ok_or_else(|| {
                        RunError::new(
                            1,
                            format!("k3-orch: {s} announced region {name} without its fd"),
                        )
                    })?;
                    data.push((id, name, fd));
                }
                other => {
                    return Err(RunError::new(
                        1,
                        format!("k3-orch: {s} sent {other:?} during set-up"),
                    ))
                }
            }
        }
    }
    Ok(data)
}

/// Step 5 of the wiring: compute gets the data regions and its configuration; once it is
/// ready every stage gets `Ready` (go).
pub(super) fn start_compute(
    launch: &Launch,
    r: &mut Running,
    compute: &k3_protocol::conf::ComputeConf,
    data: Vec<DataRegion>,
) -> Result<(), RunError> {
    let timeout = launch.stage_timeout;
    let all = Stage::WORKERS;
    let json = |v: &dyn erased::Json| v.json();
    for (id, name, fd) in &data {
        r.send(
            Stage::LayerCompute,
            &Msg::Region {
                id: *id,
                role: RegionRole::Data { name: name.clone() },
            },
            &[fd.as_fd()],
        )?;
    }
    drop(data);
    r.send(
        Stage::LayerCompute,
        &Msg::Configure {
            json: json(compute),
        },
        &[],
    )?;
    loop {
        let ev = next_event(r, timeout, &all)?;
        if let Some((s, m, _)) = handle_common(r, ev, "during set-up")? {
            match m {
                Msg::Ready { stage } if stage == s && s == Stage::LayerCompute => break,
                other => {
                    return Err(RunError::new(
                        1,
                        format!("k3-orch: {s} sent {other:?} during set-up"),
                    ))
                }
            }
        }
    }
    for s in all {
        r.send(
            s,
            &Msg::Ready {
                stage: Stage::Orchestrator,
            },
            &[],
        )?;
    }
    Ok(())
}

/// Step 6: relay one generation to the end (every stage's summary).
fn generate(
    launch: &Launch,
    r: &mut Running,
    obs: &mut dyn Observer,
    prompt_ids: Vec<u32>,
) -> Result<Outcome, RunError> {
    let timeout = launch.stage_timeout;
    let all = Stage::WORKERS;
    let mut out = Outcome {
        prompt_ids,
        ..Default::default()
    };
    obs.started();
    let mut stop_sent = false;
    let mut finished = false;
    let mut summaries_left: Vec<Stage> = all.to_vec();
    summaries_left.retain(|s| *s != Stage::LayerCompute);
    while !(finished && summaries_left.is_empty()) {
        // Compute must stay alive until Finished; the others until their Summary.
        let alive: Vec<Stage> = all
            .iter()
            .copied()
            .filter(|s| {
                if *s == Stage::LayerCompute {
                    !finished
                } else {
                    summaries_left.contains(s)
                }
            })
            .collect();
        let ev = next_event(r, timeout, &alive)?;
        // After Finished, compute exits on its own; a clean exit is expected then.
        if let StageEvent::Exit(x) = &ev {
            if let Some(s) = Stage::parse(&x.stage) {
                let done = (s == Stage::LayerCompute && finished)
                    || (s != Stage::LayerCompute && !summaries_left.contains(&s));
                if done && x.cause == ExitCause::Code(0) {
                    r.exited.insert(s, x.clone());
                    continue;
                }
            }
        }
        if let StageEvent::Control(s, Err(_)) = &ev {
            let done = (*s == Stage::LayerCompute && finished)
                || (*s != Stage::LayerCompute && !summaries_left.contains(s));
            if done {
                continue;
            }
        }
        let Some((s, m, _)) = handle_common(r, ev, "during generation")? else {
            continue;
        };
        match m {
            Msg::StepStats(st) => {
                r.progress.clear();
                obs.step(&st);
                out.steps.push(st);
            }
            Msg::Text { bytes } => {
                obs.text(&bytes);
                out.text.extend_from_slice(&bytes);
                // A stop string ended the text: compute stops too (its generation and its
                // time end there, not at --gen). It may be finished already.
                if !stop_sent && !finished && obs.stop_requested() {
                    stop_sent = true;
                    let _ = r.send(Stage::LayerCompute, &Msg::StopRequest { req: 0 }, &[]);
                }
            }
            Msg::Finished { generated } => {
                out.generated = generated;
                finished = true;
            }
            Msg::Summary { stage, json } => {
                summaries_left.retain(|x| *x != stage);
                out.summaries.insert(
                    stage.name().to_string(),
                    serde_json::from_str(&json).unwrap_or(serde_json::Value::String(json)),
                );
            }
            other => {
                return Err(RunError::new(
                    1,
                    format!("k3-orch: {s} sent {other:?} during generation"),
                ))
            }
        }
    }
    Ok(out)
}
