//! Driving a started pipeline: wire the stages (links, regions, `Configure`), encode the
//! prompt, then relay generation (step statistics, text, summaries) until every stage is
//! done, turning an exit, an `Error` or silence into a [`SuperviseError`] that names the
//! stage.
//!
//! A stage's report of a peer's death (`FailureKind::PeerDied`) is a knock-on failure:
//! [`handle_common`] waits briefly ([`KNOCK_ON_WAIT`]) for the peer's own exit or report
//! and names that stage instead.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use k3_protocol::messages::{Msg, RegionRole, Stage};
use k3_protocol::shm::Region;
use k3_protocol::transport::{ShmTransport, Side};

use super::error::SuperviseError;
use super::spawn::{ExitCause, Exited, Running, StageEvent};
use super::{erased, Launch, Mode, Observer, Outcome};

/// How long a knock-on failure (a stage reporting a peer's death) waits for the peer's own
/// exit or report, which names the real cause.
pub const KNOCK_ON_WAIT: Duration = Duration::from_millis(1500);

/// Wait for the next event, watching heartbeats; returns a failure for a silent stage.
pub(super) fn next_event(
    r: &mut Running,
    timeout: Duration,
    expect_alive: &[Stage],
) -> Result<StageEvent, SuperviseError> {
    loop {
        if super::spawn::INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
            let code = super::spawn::interrupted_exit_code();
            return Err(SuperviseError::Interrupted { signal: code - 128 });
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
                        return Err(SuperviseError::Hung { stage: *s, timeout });
                    }
                }
            }
            Err(RecvTimeoutError::Disconnected) => return Err(SuperviseError::AllGone),
        }
    }
}

/// Turn an unexpected exit into a failure naming the stage and the cause.
pub(super) fn exit_failure(r: &Running, e: &Exited) -> SuperviseError {
    let oom_limit = r
        .cgroups
        .as_ref()
        .zip(Stage::parse(&e.stage))
        .and_then(|(cg, s)| cg.oom_killed(s));
    SuperviseError::Exited {
        stage: e.stage.clone(),
        pid: e.pid,
        cause: e.cause.clone(),
        oom_limit,
    }
}

/// The failure to report for `first`: itself, unless it is a knock-on report of a peer's
/// death, in which case the first primary failure that arrives within `wait` (a stage's
/// exit, or its own report of a failure that is not a knock-on) replaces it. Without one,
/// a report that names the peer blames the peer ([`SuperviseError::KnockOn`]).
pub(super) fn blame(r: &mut Running, first: SuperviseError, wait: Duration) -> SuperviseError {
    if !first.is_knock_on() {
        return first;
    }
    let deadline = Instant::now() + wait;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match r.events.recv_timeout(left.min(Duration::from_millis(50))) {
            Ok(StageEvent::Exit(x)) => {
                let f = exit_failure(r, &x);
                if let Some(s) = Stage::parse(&x.stage) {
                    r.exited.insert(s, x);
                }
                return f;
            }
            Ok(StageEvent::Control(_, Ok((Msg::Error { stage, failure }, _))))
                if !failure.kind.is_secondary() =>
            {
                return SuperviseError::Failed { stage, failure };
            }
            // Heartbeats, other knock-on reports, closed sockets (their exit follows).
            Ok(_) | Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    match first {
        SuperviseError::Failed { stage, failure } => match failure.peer {
            Some(culprit) if culprit != Stage::Orchestrator && culprit != stage => {
                SuperviseError::KnockOn {
                    culprit,
                    reporter: stage,
                    failure,
                }
            }
            _ => SuperviseError::Failed { stage, failure },
        },
        other => other,
    }
}

/// How long a stage's exit waits for the failure report it sent just before.
const REPORT_WAIT: Duration = Duration::from_millis(200);

/// `stage`'s own failure report (`Msg::Error`), if it arrives within `wait`. Other events
/// seen meanwhile are dropped (the run is ending).
fn own_report(r: &mut Running, stage: Stage, wait: Duration) -> Option<SuperviseError> {
    let deadline = Instant::now() + wait;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match r.events.recv_timeout(left) {
            Ok(StageEvent::Control(s, Ok((Msg::Error { stage: st, failure }, _))))
                if s == stage =>
            {
                return Some(SuperviseError::Failed { stage: st, failure })
            }
            Ok(StageEvent::Exit(x)) => {
                if let Some(s) = Stage::parse(&x.stage) {
                    r.exited.insert(s, x);
                }
            }
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    None
}

pub(super) fn handle_common(
    r: &mut Running,
    ev: StageEvent,
    phase: &'static str,
) -> Result<Option<(Stage, Msg, Vec<OwnedFd>)>, SuperviseError> {
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
        StageEvent::Control(_, Ok((Msg::Error { stage, failure }, _))) => Err(blame(
            r,
            SuperviseError::Failed { stage, failure },
            KNOCK_ON_WAIT,
        )),
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
            Err(SuperviseError::ControlClosed {
                stage: s,
                phase,
                source: e,
            })
        }
        StageEvent::Exit(x) => {
            let f = exit_failure(r, &x);
            let stage = Stage::parse(&x.stage);
            if let Some(s) = stage {
                r.exited.insert(s, x);
            }
            // A stage that failed reported why before it exited; the report may still be
            // on its way (another thread reads the socket).
            Err(match stage {
                Some(s) => match own_report(r, s, REPORT_WAIT) {
                    Some(report) => blame(r, report, KNOCK_ON_WAIT),
                    None => f,
                },
                None => f,
            })
        }
    }
}

fn link_region(id: u32, a: Stage, b: Stage) -> Result<Region, SuperviseError> {
    ShmTransport::create_region(
        id,
        &format!("link-{a}-{b}"),
        &k3_protocol::link::link_ring(),
    )
    .map_err(|source| SuperviseError::LinkRegion { a, b, source })
}

/// A message the protocol does not allow from `stage` at this point.
fn unexpected(stage: Stage, m: &Msg, phase: &'static str) -> SuperviseError {
    SuperviseError::Unexpected {
        stage,
        message: format!("{m:?}"),
        phase,
    }
}

/// A data region a loader shared (id, name, fd), to pass on to compute.
pub(super) type DataRegion = (u32, String, OwnedFd);

/// Run the pipeline; on success the outcome, else a failure with its exit code. Stages are
/// always stopped and reaped before this returns.
pub(super) fn drive(
    launch: &Launch,
    r: &mut Running,
    obs: &mut dyn Observer,
) -> Result<Outcome, SuperviseError> {
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
                    other => return Err(unexpected(s, &other, "while encoding")),
                }
            }
        }
    }
    if compute.prompt_ids.is_empty() && compute.load_state.is_none() {
        return Err(SuperviseError::EmptyPrompt);
    }
    if compute.prompt_ids.len() > k3_protocol::conf::MAX_PROMPT_IDS {
        return Err(SuperviseError::PromptTooLong {
            len: compute.prompt_ids.len(),
            max: k3_protocol::conf::MAX_PROMPT_IDS,
        });
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
pub(super) fn wire(launch: &Launch, r: &mut Running) -> Result<Vec<DataRegion>, SuperviseError> {
    let hello = await_hello(launch, r)?;
    send_links(launch, r, &hello)?;
    configure_servers(launch, r)
}

/// Step 1: `Hello` from every worker, in the protocol's version; their pids.
fn await_hello(launch: &Launch, r: &mut Running) -> Result<HashMap<Stage, u32>, SuperviseError> {
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
                        return Err(SuperviseError::Version { stage: s, version });
                    }
                    hello.insert(s, pid);
                }
                other => return Err(unexpected(s, &other, "before Hello")),
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
) -> Result<(), SuperviseError> {
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
fn configure_servers(launch: &Launch, r: &mut Running) -> Result<Vec<DataRegion>, SuperviseError> {
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
                    let Some(fd) = fds.pop() else {
                        return Err(SuperviseError::MissingFd { stage: s, name });
                    };
                    data.push((id, name, fd));
                }
                other => return Err(unexpected(s, &other, "during set-up")),
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
) -> Result<(), SuperviseError> {
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
                other => return Err(unexpected(s, &other, "during set-up")),
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
) -> Result<Outcome, SuperviseError> {
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
            other => return Err(unexpected(s, &other, "during generation")),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::mpsc::{channel, Sender};

    use k3_protocol::failure::{FailureKind, StageFailure};

    use super::*;
    use crate::error::RunError;

    /// A pipeline with no stages behind it: events come from the test.
    fn running() -> (Running, Sender<StageEvent>) {
        let (tx, rx) = channel();
        let r = Running {
            controls: HashMap::new(),
            watcher: None,
            threads: Vec::new(),
            events: rx,
            pids: HashMap::new(),
            last_seen: HashMap::new(),
            exited: HashMap::new(),
            cgroups: None,
            notes: Vec::new(),
            numa: HashMap::new(),
            progress: super::super::progress::Progress::new(false),
        };
        (r, tx)
    }

    fn report(stage: Stage, failure: StageFailure) -> StageEvent {
        StageEvent::Control(stage, Ok((Msg::Error { stage, failure }, Vec::new())))
    }

    fn killed(stage: Stage) -> StageEvent {
        StageEvent::Exit(Exited {
            stage: stage.name().to_string(),
            pid: 42,
            cause: ExitCause::Signal(libc::SIGKILL),
            peak_rss_bytes: 0,
        })
    }

    /// The failure `ev` ends the run with, as the CLI reports it, and the stage blamed.
    fn outcome(r: &mut Running, ev: StageEvent) -> (RunError, Option<Stage>) {
        let e = handle_common(r, ev, "during generation").expect_err("a failure");
        let culprit = e.culprit();
        (RunError::from(e), culprit)
    }

    // Catches an exit code or a blamed stage read from the message's wording (or a fixed 1
    // for every failure): each comes from the reported kind and the reporting stage.
    #[test]
    fn a_stage_failure_is_blamed_and_coded_by_its_kind() {
        for (stage, kind, code) in [
            (Stage::ExpertFetcher, FailureKind::ExpertLoad, 1),
            (Stage::LayerCompute, FailureKind::Bind, 1),
            (Stage::LayerCompute, FailureKind::Forward, 1),
            (Stage::TrunkLoader, FailureKind::Config, 2),
        ] {
            let (mut r, _tx) = running();
            let f = StageFailure::new(kind, "it broke");
            let (e, culprit) = outcome(&mut r, report(stage, f));
            assert_eq!(e.code, code, "{kind:?}: {}", e.msg);
            assert_eq!(culprit, Some(stage), "{kind:?}");
            assert_eq!(e.msg, format!("k3-orch: stage {stage} failed: it broke"));
        }
    }

    // Catches the knock-on report blamed: layer-compute says its trunk link died; the
    // trunk-loader's own exit (SIGKILL) follows and is what the run reports.
    #[test]
    fn a_peer_death_report_gives_way_to_the_peers_exit() {
        let (mut r, tx) = running();
        let f = StageFailure::new(FailureKind::PeerDied, "layer-compute: link to trunk-loader")
            .with_peer(Stage::TrunkLoader);
        tx.send(report(
            Stage::Tokenizer,
            StageFailure::new(FailureKind::PeerDied, "x"),
        ))
        .unwrap();
        tx.send(killed(Stage::TrunkLoader)).unwrap();
        let (e, culprit) = outcome(&mut r, report(Stage::LayerCompute, f));
        assert_eq!(culprit, Some(Stage::TrunkLoader));
        assert_eq!(e.code, 1);
        assert!(
            e.msg.contains("stage trunk-loader") && e.msg.contains("SIGKILL"),
            "{}",
            e.msg
        );
        assert!(r.exited.contains_key(&Stage::TrunkLoader));
    }

    // The culprit's own report (not a knock-on) replaces the knock-on one, with its code.
    #[test]
    fn a_peer_death_report_gives_way_to_the_peers_own_report() {
        let (mut r, tx) = running();
        let f = StageFailure::new(FailureKind::PeerDied, "lost the fetcher")
            .with_peer(Stage::ExpertFetcher);
        tx.send(report(
            Stage::ExpertFetcher,
            StageFailure::new(FailureKind::Config, "no such shard"),
        ))
        .unwrap();
        let (e, culprit) = outcome(&mut r, report(Stage::LayerCompute, f));
        assert_eq!(culprit, Some(Stage::ExpertFetcher));
        assert_eq!(e.code, 2, "{}", e.msg);
        assert!(e.msg.contains("no such shard"), "{}", e.msg);
    }

    // Without the peer's own word, the report still blames the peer it names, not the
    // stage that reported it.
    #[test]
    fn a_peer_death_report_alone_blames_the_peer() {
        let (mut r, _tx) = running();
        let f = StageFailure::new(FailureKind::PeerDied, "layer-compute: link to tokenizer")
            .with_peer(Stage::Tokenizer);
        let first = SuperviseError::Failed {
            stage: Stage::LayerCompute,
            failure: f,
        };
        assert!(first.is_knock_on());
        let e = blame(&mut r, first, Duration::from_millis(50));
        assert_eq!(e.culprit(), Some(Stage::Tokenizer));
        assert!(matches!(e, SuperviseError::KnockOn { .. }), "{e}");
        let e = RunError::from(e);
        assert_eq!(e.code, 1);
        assert!(
            e.msg.starts_with("k3-orch: stage tokenizer is gone"),
            "{}",
            e.msg
        );
    }

    // A stage that exits after reporting is named with its report (the kind, so the exit
    // code), not only its exit status.
    #[test]
    fn an_exit_takes_the_report_sent_before_it() {
        let (mut r, tx) = running();
        tx.send(report(
            Stage::TrunkLoader,
            StageFailure::new(FailureKind::Config, "the packed trunk does not fit"),
        ))
        .unwrap();
        let exit = StageEvent::Exit(Exited {
            stage: "trunk-loader".into(),
            pid: 7,
            cause: ExitCause::Code(2),
            peak_rss_bytes: 0,
        });
        let (e, culprit) = outcome(&mut r, exit);
        assert_eq!(
            (e.code, culprit),
            (2, Some(Stage::TrunkLoader)),
            "{}",
            e.msg
        );
        assert!(e.msg.contains("does not fit"), "{}", e.msg);
    }

    #[test]
    fn supervisor_faults_have_their_own_codes() {
        let code = |e: SuperviseError| RunError::from(e).code;
        assert_eq!(code(SuperviseError::Interrupted { signal: 15 }), 143);
        assert_eq!(code(SuperviseError::EmptyPrompt), 2);
        let hung = SuperviseError::Hung {
            stage: Stage::TrunkLoader,
            timeout: Duration::from_secs(5),
        };
        assert_eq!(hung.culprit(), Some(Stage::TrunkLoader));
        assert_eq!(code(hung), 1);
    }
}
