//! The [`Scheduler`] (issue 33, the compute side): requests decoding together give each
//! request the ids and logits it gets alone, bit for bit, and the scheduler keeps its
//! bounds (slots, queue, prompt chunk, context), frees a slot at once, and reuses prefixes.
//!
//! "Alone" is the ONE decode loop ([`decode_loop`], incremental, the prompt in one pass),
//! the path every mode runs today; nothing here compares the scheduler with itself.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use crate::support::*;
use k3_layer_compute::batch::{
    Event, FinishReason, Refused, Request, RequestId, Scheduler, SchedulerOptions,
};
use k3_layer_compute::decode::{decode_loop, LoopOptions, Step, StepHooks};
use k3_layer_compute::sampler::SamplerConfig;
use k3_layer_compute::{Model, Weights};

const MODELS: [&str; 2] = ["tiny-seed", "tiny-mxfp4"];

fn full_ids(model: &str) -> Vec<u32> {
    let e = read_json(&fixtures().join(format!("{model}/expected-k3ref.json")));
    ids(&e, "full_ids")
}

/// Every step's logits row (the last row of each step's output).
#[derive(Default)]
struct Rows(Vec<Vec<f32>>);

impl StepHooks for Rows {
    type Error = std::convert::Infallible;

    fn on_step(&mut self, s: Step<'_>) -> Result<(), Self::Error> {
        let v = s.out.logits.len() / s.out.rows;
        self.0.push(s.out.logits[(s.out.rows - 1) * v..].to_vec());
        Ok(())
    }
}

/// A request's ids and every step's logits row.
#[derive(Clone, Debug, Default, PartialEq)]
struct Run {
    ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

/// `r` alone through the decode loop (incremental, one prompt pass).
fn alone<W: Weights>(m: &Model<W>, r: &Request) -> Run {
    let mut rows = Rows::default();
    let ids = decode_loop(
        m,
        &LoopOptions {
            prompt: &r.prompt,
            gen: r.max_tokens,
            incremental: true,
            sampler: r.sampler,
            stop_ids: &r.stop_ids,
            dump_logits: None,
            prefill_chunk: None,
        },
        &mut rows,
    )
    .unwrap();
    Run {
        ids,
        logits: rows.0,
    }
}

fn sampled(seed: u64, t: f32) -> SamplerConfig {
    SamplerConfig {
        temperature: Some(t),
        seed,
        ..SamplerConfig::default()
    }
}

/// Eight requests over the fixture's ids: (offset, prompt length, max tokens, the step it
/// is submitted at, sampler). Greedy and seeded sampled (top-p, top-k, min-p, a repetition
/// penalty), prompts of 1 to 12 tokens, submitted at different steps.
fn requests(all: &[u32]) -> Vec<(Request, usize)> {
    let specs: [(usize, usize, usize, usize, SamplerConfig); 8] = [
        (0, 12, 8, 0, SamplerConfig::default()),
        (
            3,
            1,
            6,
            0,
            SamplerConfig {
                top_p: Some(0.95),
                ..sampled(7, 0.9)
            },
        ),
        (5, 7, 5, 2, SamplerConfig::default()),
        (
            1,
            9,
            7,
            1,
            SamplerConfig {
                top_k: Some(20),
                repetition_penalty: Some(1.3),
                ..sampled(11, 1.3)
            },
        ),
        (
            8,
            3,
            4,
            5,
            SamplerConfig {
                repetition_penalty: Some(1.2),
                ..SamplerConfig::default()
            },
        ),
        (
            2,
            11,
            6,
            3,
            SamplerConfig {
                min_p: Some(0.05),
                ..sampled(3, 0.7)
            },
        ),
        (10, 2, 9, 7, sampled(99, 1.0)),
        (4, 5, 6, 4, SamplerConfig::default()),
    ];
    specs
        .iter()
        .map(|&(o, len, max, join, sampler)| {
            let mut r = Request::greedy(all[o..o + len].to_vec(), max);
            r.sampler = sampler;
            r.keep_logits = true;
            (r, join)
        })
        .collect()
}

/// What a scheduler run gave each request, and what its passes looked like.
#[derive(Default)]
struct Batched {
    runs: Vec<Run>,
    reasons: Vec<FinishReason>,
    /// Passes that carried decode rows and prompt rows together.
    mixed_passes: usize,
    /// Most decode rows in one pass.
    max_decode_rows: usize,
}

/// Run `reqs` through a scheduler, each submitted at its step; check the event stream of
/// every request (Started, then Prefill/Token in order, then one Finished whose ids are
/// the tokens streamed) and the pass bounds (`chunk` prompt rows, one decode row per
/// decoding slot).
fn batched<W: Weights>(m: &Model<W>, reqs: &[(Request, usize)], opts: SchedulerOptions) -> Batched {
    let mut s = Scheduler::new(m, opts).unwrap();
    let mut index: BTreeMap<RequestId, usize> = BTreeMap::new();
    let mut out = Batched {
        runs: vec![Run::default(); reqs.len()],
        reasons: vec![FinishReason::Cancelled; reqs.len()],
        ..Batched::default()
    };
    let mut started = vec![false; reqs.len()];
    let mut finished = vec![false; reqs.len()];
    for step in 0..1000 {
        for (i, (r, join)) in reqs.iter().enumerate() {
            if *join == step {
                index.insert(s.submit(r.clone()).unwrap(), i);
            }
        }
        let rep = s.step(m);
        assert!(rep.error.is_none(), "{:?}", rep.error);
        assert!(rep.prefill_rows <= opts.chunk, "prompt rows over the chunk");
        assert!(rep.decode_rows <= opts.slots, "decode rows over the slots");
        assert_eq!(rep.rows, rep.decode_rows + rep.prefill_rows);
        if rep.decode_rows > 0 && rep.prefill_rows > 0 {
            out.mixed_passes += 1;
        }
        out.max_decode_rows = out.max_decode_rows.max(rep.decode_rows);
        for e in rep.events {
            match e {
                Event::Started { id, .. } => {
                    let i = index[&id];
                    assert!(!started[i], "started twice");
                    started[i] = true;
                }
                Event::Prefill { id, .. } => assert!(started[index[&id]]),
                Event::Token {
                    id,
                    index: k,
                    token,
                    logits,
                } => {
                    let i = index[&id];
                    assert!(started[i] && !finished[i]);
                    assert_eq!(k, out.runs[i].ids.len(), "token indices in order");
                    out.runs[i].ids.push(token);
                    out.runs[i].logits.push(logits.expect("logits kept"));
                }
                Event::Finished {
                    id,
                    reason,
                    generated,
                    expert_failures,
                } => {
                    let i = index[&id];
                    assert!(!finished[i], "finished twice");
                    finished[i] = true;
                    assert_eq!(generated, out.runs[i].ids, "Finished's ids");
                    assert_eq!(expert_failures, 0);
                    out.reasons[i] = reason;
                }
                Event::Failed { error, .. } => panic!("a request failed: {error}"),
            }
        }
        let all_in = reqs.iter().all(|(_, j)| *j <= step);
        if all_in && s.is_idle() {
            assert!(finished.iter().all(|&f| f), "every request finished");
            assert_eq!(s.state_bytes(), 0, "every slot freed");
            return out;
        }
    }
    panic!("the scheduler did not finish in 1000 steps");
}

/// Compare every request's batched run with its alone run, bit for bit.
fn check(what: &str, reqs: &[(Request, usize)], want: &[Run], got: &Batched) {
    for (i, ((r, _), (w, g))) in reqs.iter().zip(want.iter().zip(&got.runs)).enumerate() {
        assert_eq!(g.ids, w.ids, "{what}: request {i}'s ids");
        assert_eq!(
            g.logits.len(),
            w.logits.len(),
            "{what}: request {i}'s steps"
        );
        for (k, (a, b)) in g.logits.iter().zip(&w.logits).enumerate() {
            assert_bits_eq(&format!("{what}: request {i} step {k}"), a, b);
        }
        let stopped = w.ids.last().is_some_and(|t| r.stop_ids.contains(t));
        let reason = if stopped {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        assert_eq!(got.reasons[i], reason, "{what}: request {i}'s reason");
    }
}

// Catches: a slot sampled with another slot's sampler, seed or step count (a seeded request
// draws differently beside others), a decode row fed the wrong slot's last id, a prompt
// chunk taken from the wrong offset or fed twice, logits handed to the wrong slot, a
// session shared or swapped between slots (an MLA cache or KDA state of another request),
// an MoE that mixes rows of different requests, a request that starts from another's
// state, stop ids or max_tokens checked against the wrong slot. Beside 1, 3 and 7 others,
// submitted at different steps, some prefilling in chunks while others decode, with as many
// slots as requests and with fewer (a queue); on both tiny models and every SIMD path.
#[test]
fn each_request_gets_its_alone_bits_beside_1_3_and_7_others() {
    for path in host_paths("each_request_gets_its_alone_bits_beside_1_3_and_7_others") {
        let _cap = cap_isa(path);
        for model in MODELS {
            let all = full_ids(model);
            let m = load(model, 1);
            let mut reqs = requests(&all);
            // The last request stops at its second generated id (the rule: kept).
            let free = alone(&m, &reqs[7].0);
            reqs[7].0.stop_ids = vec![free.ids[1]];
            let want: Vec<Run> = reqs.iter().map(|(r, _)| alone(&m, r)).collect();
            assert!(want[7].ids.len() <= 2 && want[7].ids.len() < reqs[7].0.max_tokens);
            // (others, slots, chunk, threads)
            for (others, slots, chunk, threads) in [
                (1, 2, 3, 1),
                (3, 4, 2, 1),
                (7, 8, 3, 1),
                (7, 3, 5, 2),
                (7, 8, 64, 2),
            ] {
                let what = format!(
                    "{model} {}: beside {others}, {slots} slots, chunk {chunk}, {threads} threads",
                    path.name()
                );
                let m = load(model, threads);
                let reqs = &reqs[..=others];
                let got = batched(
                    &m,
                    reqs,
                    SchedulerOptions {
                        slots,
                        max_queue: 8,
                        chunk,
                        ctx: 64,
                        prefix_entries: 0,
                    },
                );
                check(&what, reqs, &want, &got);
                // The passes did carry several requests, prompts beside decode rows.
                assert!(
                    got.mixed_passes > 0,
                    "{what}: no pass mixed prefill and decode"
                );
                assert!(got.max_decode_rows >= 2, "{what}: never two decode rows");
            }
        }
    }
}

// Catches a queue without a bound, a full queue that still takes requests (or drops one
// silently), a request refused for the slots' free room, and invalid requests taken in
// (an empty prompt, an id outside the vocabulary, more tokens than a slot holds).
#[test]
fn submit_refuses_what_cannot_run_and_bounds_the_queue() {
    let _kernels = kernels_shared();
    let m = load("tiny-mxfp4", 1);
    let opts = SchedulerOptions {
        slots: 2,
        max_queue: 2,
        chunk: 4,
        ctx: 16,
        prefix_entries: 0,
    };
    let mut s = Scheduler::new(&m, opts).unwrap();
    assert!(matches!(
        s.submit(Request::greedy(vec![], 2)),
        Err(Refused::Invalid(_))
    ));
    assert!(matches!(
        s.submit(Request::greedy(vec![1, 256], 2)),
        Err(Refused::Invalid(_))
    ));
    assert!(matches!(
        s.submit(Request::greedy(vec![1; 10], 7)),
        Err(Refused::Invalid(_))
    ));
    // 10 + 6 = 16 fits.
    for _ in 0..4 {
        s.submit(Request::greedy(vec![1; 10], 6)).unwrap();
    }
    assert_eq!(
        s.submit(Request::greedy(vec![1], 1)),
        Err(Refused::QueueFull(4))
    );
    let rep = s.step(&m);
    assert_eq!((s.busy(), s.queued()), (2, 2));
    assert_eq!(rep.prefill_rows, 4);
    assert_eq!(
        s.submit(Request::greedy(vec![1], 1)),
        Err(Refused::QueueFull(2))
    );
    assert!(Scheduler::new(&m, SchedulerOptions { slots: 0, ..opts }).is_err());
}

// Catches a cancelled request that keeps its slot (or runs one more pass), a queued request
// that does not take the freed slot at that very step, a cancel of a queued request that
// still starts it, and a zero-token request that runs a pass.
#[test]
fn cancel_frees_the_slot_for_the_next_request_at_once() {
    let _kernels = kernels_shared();
    let m = load("tiny-seed", 1);
    let all = full_ids("tiny-seed");
    let mut s = Scheduler::new(
        &m,
        SchedulerOptions {
            slots: 1,
            max_queue: 4,
            chunk: 16,
            ctx: 64,
            prefix_entries: 0,
        },
    )
    .unwrap();
    let a = Request::greedy(all[..6].to_vec(), 10);
    let a_cancel = a.cancel.clone();
    let ia = s.submit(a).unwrap();
    let ib = s.submit(Request::greedy(all[6..10].to_vec(), 3)).unwrap();
    let ic = s.submit(Request::greedy(all[1..4].to_vec(), 3)).unwrap();
    let iz = s.submit(Request::greedy(all[2..4].to_vec(), 0)).unwrap();
    let rep = s.step(&m);
    assert!(matches!(rep.events[0], Event::Started { id, .. } if id == ia));
    assert!(matches!(rep.events[1], Event::Token { id, index: 0, .. } if id == ia));
    s.step(&m);
    assert!(s.cancel(ic), "a queued request can be cancelled");
    a_cancel.store(true, Ordering::Relaxed);
    let rep = s.step(&m);
    // C ends without starting; A ends with its two ids; B takes the slot and runs this pass.
    let kinds: Vec<String> = rep
        .events
        .iter()
        .map(|e| match e {
            Event::Started { id, .. } => format!("start {id}"),
            Event::Prefill { id, .. } => format!("prefill {id}"),
            Event::Token { id, index, .. } => format!("token {id}.{index}"),
            Event::Finished {
                id,
                reason,
                generated,
                ..
            } => format!("end {id} {reason:?} {}", generated.len()),
            Event::Failed { id, .. } => format!("failed {id}"),
        })
        .collect();
    assert_eq!(
        kinds,
        [
            format!("end {ic} Cancelled 0"),
            format!("end {ia} Cancelled 2"),
            format!("start {ib}"),
            format!("token {ib}.0"),
        ]
    );
    assert!(!s.cancel(ia), "A is gone");
    while !s.is_idle() {
        let rep = s.step(&m);
        for e in rep.events {
            if let Event::Finished { id, reason, .. } = e {
                if id == iz {
                    assert_eq!(rep.rows, 0, "a zero-token request runs no pass");
                    assert_eq!(reason, FinishReason::Length);
                }
            }
        }
    }
}

// Catches chunked prefill that serves the newest slot first, a chunk budget per slot
// instead of per pass (several prompts at once over the chunk), prefill progress that
// skips or repeats tokens, and a decode row left out for a slot that decodes while another
// prefills.
#[test]
fn prompts_are_fed_oldest_first_within_the_chunk() {
    let _kernels = kernels_shared();
    let m = load("tiny-mxfp4", 1);
    let all = full_ids("tiny-mxfp4");
    let mut s = Scheduler::new(
        &m,
        SchedulerOptions {
            slots: 3,
            max_queue: 0,
            chunk: 4,
            ctx: 64,
            prefix_entries: 0,
        },
    )
    .unwrap();
    let ia = s.submit(Request::greedy(all[..6].to_vec(), 5)).unwrap();
    let ib = s.submit(Request::greedy(all[3..10].to_vec(), 5)).unwrap();
    let ic = s.submit(Request::greedy(all[9..11].to_vec(), 5)).unwrap();
    // (decode rows, prefill rows) per pass, and the prompt progress.
    let mut shape = Vec::new();
    let mut progress = Vec::new();
    while !s.is_idle() {
        let rep = s.step(&m);
        shape.push((rep.decode_rows, rep.prefill_rows));
        for e in rep.events {
            match e {
                Event::Prefill { id, done, total } => progress.push((id, done, total)),
                Event::Token { id, index: 0, .. } => progress.push((id, usize::MAX, 0)),
                _ => {}
            }
        }
    }
    // A: 4, then A's last 2 + B's first 2 (A decodes from the pass after), B 4 beside A's
    // decode row, B's last 1 + C's 2 beside A's, then three decode rows.
    assert_eq!(&shape[..5], &[(0, 4), (0, 4), (1, 4), (1, 3), (3, 0)]);
    assert_eq!(
        progress,
        [
            (ia, 4, 6),
            (ia, usize::MAX, 0),
            (ib, 2, 7),
            (ib, 6, 7),
            (ib, usize::MAX, 0),
            (ic, usize::MAX, 0),
        ]
    );
    assert!(shape.iter().all(|&(d, p)| d <= 3 && p <= 4));
}

// Catches a kept prefix that is not put into the slot (cached_tokens 0), a wrong count, a
// kept state that holds the last generated id (or misses one), and a reused state that
// changes the request's ids or logits.
#[test]
fn a_kept_prefix_is_reused_and_reported() {
    let _kernels = kernels_shared();
    for model in MODELS {
        let m = load(model, 1);
        let all = full_ids(model);
        let mut s = Scheduler::new(
            &m,
            SchedulerOptions {
                slots: 2,
                max_queue: 4,
                chunk: 3,
                ctx: 64,
                prefix_entries: 4,
            },
        )
        .unwrap();
        let first = Request::greedy(all[..7].to_vec(), 4);
        s.submit(first.clone()).unwrap();
        let mut gen = Vec::new();
        while !s.is_idle() {
            for e in s.step(&m).events {
                if let Event::Finished { generated, .. } = e {
                    gen = generated;
                }
            }
        }
        assert_eq!(gen.len(), 4);
        // A follow-up that extends the conversation: the prompt, the first three ids (the
        // fourth was never fed), and more.
        let mut prompt = all[..7].to_vec();
        prompt.extend_from_slice(&gen);
        prompt.extend_from_slice(&all[20..23]);
        let mut follow = Request::greedy(prompt, 5);
        follow.keep_logits = true;
        follow.sampler = sampled(5, 0.8);
        let want = alone(&m, &follow);
        let id = s.submit(follow).unwrap();
        let mut got = Run::default();
        let mut cached = None;
        while !s.is_idle() {
            for e in s.step(&m).events {
                match e {
                    Event::Started {
                        id: i,
                        cached_tokens,
                        ..
                    } if i == id => cached = Some(cached_tokens),
                    Event::Token { token, logits, .. } => {
                        got.ids.push(token);
                        got.logits.push(logits.unwrap());
                    }
                    _ => {}
                }
            }
        }
        assert_eq!(cached, Some(7 + 3), "{model}: cached tokens");
        assert_eq!(got.ids, want.ids, "{model}: ids with the kept prefix");
        for (k, (a, b)) in got.logits.iter().zip(&want.logits).enumerate() {
            assert_bits_eq(&format!("{model}: step {k}"), a, b);
        }
        // An unrelated prompt starts fresh.
        let other = Request::greedy(all[15..19].to_vec(), 2);
        s.submit(other).unwrap();
        let rep = s.step(&m);
        assert!(matches!(
            rep.events[0],
            Event::Started {
                cached_tokens: 0,
                ..
            }
        ));
    }
}

/// Run `r` alone on scheduler `s` to its end: (cached tokens, ids, logits rows).
fn run_on<W: Weights>(s: &mut Scheduler, m: &Model<W>, r: Request) -> (usize, Run) {
    let id = s.submit(r).unwrap();
    let (mut cached, mut run) = (usize::MAX, Run::default());
    while !s.is_idle() {
        for e in s.step(m).events {
            match e {
                Event::Started {
                    id: i,
                    cached_tokens,
                    ..
                } if i == id => cached = cached_tokens,
                Event::Token { token, logits, .. } => {
                    run.ids.push(token);
                    run.logits.push(logits.unwrap_or_default());
                }
                _ => {}
            }
        }
    }
    (cached, run)
}

// A chat's next turn starts after the history (the last complete message), not after the
// reply's ids: `snapshot_at` keeps that state on the way through the prompt (the chunks stop
// there once, which changes no bit). Catches a snapshot that is not kept (cached 0), one kept
// at the wrong point (another count), and a chunking around it that changes the ids or
// logits; and the byte bound: a cache whose bytes cannot hold a state keeps nothing.
#[test]
fn a_snapshot_inside_the_prompt_is_kept_and_the_bytes_are_bounded() {
    let _kernels = kernels_shared();
    for model in MODELS {
        let m = load(model, 1);
        let all = full_ids(model);
        let opts = SchedulerOptions {
            slots: 2,
            max_queue: 4,
            chunk: 4,
            ctx: 64,
            prefix_entries: 4,
        };
        let mut s = Scheduler::new(&m, opts).unwrap();
        let mut first = Request::greedy(all[..9].to_vec(), 3);
        first.snapshot_at = Some(6);
        first.keep_logits = true;
        let want_first = alone(&m, &first);
        let (cached, got) = run_on(&mut s, &m, first);
        assert_eq!(cached, 0);
        assert_eq!(got.ids, want_first.ids, "{model}: ids with a snapshot");
        for (k, (a, b)) in got.logits.iter().zip(&want_first.logits).enumerate() {
            assert_bits_eq(&format!("{model}: snapshot step {k}"), a, b);
        }
        // Another turn after the same six-token history (not the first prompt's end).
        let mut prompt = all[..6].to_vec();
        prompt.extend_from_slice(&all[24..28]);
        let mut next = Request::greedy(prompt, 4);
        next.keep_logits = true;
        let want = alone(&m, &next);
        let (cached, got) = run_on(&mut s, &m, next.clone());
        assert_eq!(cached, 6, "{model}: the history's state is reused");
        assert_eq!(got.ids, want.ids, "{model}: ids after the snapshot");
        for (k, (a, b)) in got.logits.iter().zip(&want.logits).enumerate() {
            assert_bits_eq(&format!("{model}: after the snapshot, step {k}"), a, b);
        }
        assert!(s.prefix_cache().bytes() > 0);
        // Bytes: a cache of one byte keeps no state at all.
        let mut tight = Scheduler::new(&m, opts).unwrap();
        tight.prefix_cache().byte_cap = 1;
        let mut r = Request::greedy(all[..9].to_vec(), 3);
        r.snapshot_at = Some(6);
        run_on(&mut tight, &m, r);
        assert!(
            tight.prefix_cache().is_empty(),
            "{model}: over the byte bound"
        );
        let (cached, _) = run_on(&mut tight, &m, next);
        assert_eq!(cached, 0, "{model}");
        // Room for one state: the newer one stays, the bytes stay under the bound.
        let mut one = Scheduler::new(&m, opts).unwrap();
        run_on(&mut one, &m, Request::greedy(all[..5].to_vec(), 2));
        let b = one.prefix_cache().bytes();
        assert!(b > 0);
        one.prefix_cache().byte_cap = b + b / 2;
        let (_, second) = run_on(&mut one, &m, Request::greedy(all[10..15].to_vec(), 2));
        assert_eq!(one.prefix_cache().len(), 1, "{model}");
        assert!(one.prefix_cache().bytes() <= b + b / 2);
        // The kept key: the prompt and the first generated id (the last was never fed).
        let mut prompt = all[10..15].to_vec();
        prompt.extend_from_slice(&[second.ids[0], all[0]]);
        let (cached, _) = run_on(&mut one, &m, Request::greedy(prompt, 1));
        assert_eq!(cached, 6, "{model}: the newer state is the one kept");
    }
}
