//! One forward pass over several sessions (`Model::forward_batch`, issue 33) and the dead
//! prompt rows of a pass's last layer (issue 32), on both tiny models.
//!
//! - Each group's logits, and its session afterwards, are bit for bit those of the same
//!   group run alone, whatever shares the pass, on every SIMD path this host has.
//! - A pass reads its weights once: one `begin_layer` per layer, one announce and one
//!   expert request per MoE layer (the union of the groups' routes), one lm_head.
//! - Rows whose logits nobody reads stop at what the caches keep in the last layer: the
//!   wanted rows' logits and every later step are unchanged, the skipped work is counted,
//!   and the last layer reads only the wanted rows' experts.

use std::cell::RefCell;
use std::collections::BTreeSet;

use crate::support::*;
use k3_layer_compute::Weights;
use k3_layer_compute::{Delivery, Group, Model, ModelOptions, Session, SourceWeights, Want};
use k3_model::config::ModelConfig;
use k3_model::mmap_weights::MmapWeights;
use k3_model::tensor::{TensorRef, WeightError};

const MODELS: [&str; 2] = ["tiny-seed", "tiny-mxfp4"];

/// The fixture's prompt and generated ids (k3ref) of `model`.
fn full_ids(model: &str) -> Vec<u32> {
    let e = read_json(&fixtures().join(format!("{model}/expected-k3ref.json")));
    ids(&e, "full_ids")
}

/// What one group does in the mixed pass of [`mixed_pass`]: tokens consumed before it (its
/// history), the ids it runs, and the rows it wants.
struct Plan {
    before: usize,
    len: usize,
    want: Want,
}

/// Sessions at different positions in one pass: a decode row, a chunk that wants every
/// row, a chunk that wants none (a prefill pass before the last), a fresh prompt that wants
/// its last row, and a second decode row. Offsets into the fixture's ids differ per group so
/// no two groups run the same tokens.
fn plans() -> Vec<(usize, Plan)> {
    vec![
        (
            0,
            Plan {
                before: 9,
                len: 1,
                want: Want::Last,
            },
        ),
        (
            3,
            Plan {
                before: 4,
                len: 5,
                want: Want::All,
            },
        ),
        (
            7,
            Plan {
                before: 2,
                len: 3,
                want: Want::None,
            },
        ),
        (
            11,
            Plan {
                before: 0,
                len: 4,
                want: Want::Last,
            },
        ),
        (
            5,
            Plan {
                before: 14,
                len: 1,
                want: Want::Last,
            },
        ),
    ]
}

/// A session that has consumed `ids` (one prefill; a later test shows the pass split does
/// not matter).
fn fed<W: Weights>(m: &Model<W>, ids: &[u32]) -> Session {
    let mut s = m.new_session();
    if !ids.is_empty() {
        m.prefill(&mut s, ids).unwrap();
    }
    s
}

/// Run every plan in ONE pass, and each alone; compare the logits, then take one more
/// step from each session (the batched one and the alone one) and compare again: a state
/// left wrong by the batch (a cache or a KDA state written by another group) shows there.
fn mixed_pass<W: Weights>(m: &Model<W>, all: &[u32], what: &str) {
    let plans = plans();
    let mut batched: Vec<Session> = plans
        .iter()
        .map(|(o, p)| fed(m, &all[*o..*o + p.before]))
        .collect();
    let mut alone: Vec<Session> = batched.clone();
    let out = {
        let mut groups: Vec<Group<'_>> = batched
            .iter_mut()
            .zip(&plans)
            .map(|(s, (o, p))| Group {
                session: s,
                ids: &all[o + p.before..o + p.before + p.len],
                want: p.want,
            })
            .collect();
        m.forward_batch(&mut groups, None).unwrap()
    };
    assert_eq!(out.groups.len(), plans.len());
    for (i, ((o, p), got)) in plans.iter().zip(out.groups).enumerate() {
        let got = got.unwrap();
        let ids = &all[o + p.before..o + p.before + p.len];
        let mut g = [Group {
            session: &mut alone[i],
            ids,
            want: p.want,
        }];
        let want = m.forward_batch(&mut g, None).unwrap();
        let want = want.groups.into_iter().next().unwrap().unwrap();
        let rows = match p.want {
            Want::All => p.len,
            Want::Last => 1,
            Want::None => 0,
        };
        assert_eq!(
            (got.rows, want.rows),
            (rows, rows),
            "{what} group {i}: rows"
        );
        if rows > 0 {
            assert_bits_eq(
                &format!("{what} group {i}: logits in the pass vs alone"),
                &got.logits,
                &want.logits,
            );
        }
        assert_eq!(
            batched[i].len(),
            p.before + p.len,
            "{what} group {i}: length"
        );
        // Every row against the teacher-forced rows of its whole sequence, too.
        if p.want == Want::All {
            let tf = m
                .forward_all(&all[*o..o + p.before + p.len])
                .unwrap()
                .logits;
            let v = m.vocab();
            assert_bits_eq(
                &format!("{what} group {i}: every row vs teacher forcing"),
                &got.logits,
                &tf[p.before * v..],
            );
        }
    }
    // One more token for each, from the batched session and from the alone one.
    for (i, (o, p)) in plans.iter().enumerate() {
        let next = all[o + p.before + p.len];
        let a = m.step(&mut batched[i], next).unwrap();
        let b = m.step(&mut alone[i], next).unwrap();
        assert_bits_eq(
            &format!("{what} group {i}: the step after the pass"),
            &a.logits,
            &b.logits,
        );
    }
}

// Catches: one session's MLA cache or KDA state (or conv tails) shared between the groups
// of a pass, or a group attending to another group's cached positions (the logits and the
// next step differ from the group alone); a group's rows taken from the wrong offset of the
// pass (a pass boundary off by one); an MoE combine that mixes rows (an expert's output put
// back on another row); logits rows handed to the wrong group, or the last row of a group
// taken from the pass's last row; positions that restart per group. Run on every SIMD path.
#[test]
fn a_pass_over_several_sessions_gives_each_its_alone_bits() {
    for path in host_paths("a_pass_over_several_sessions_gives_each_its_alone_bits") {
        let _cap = cap_isa(path);
        for model in MODELS {
            let all = full_ids(model);
            for threads in [1, 2] {
                let m = load(model, threads);
                mixed_pass(
                    &m,
                    &all,
                    &format!("{model} {} threads {threads}", path.name()),
                );
            }
        }
    }
}

/// Every call the forward makes on its weights, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    Begin(usize),
    End(usize),
    Announce(usize, Vec<u32>),
    Experts(usize, Vec<u32>),
    Head,
}

/// [`Weights`] over the tiny model that logs the calls.
struct Counting {
    inner: SourceWeights<MmapWeights>,
    log: RefCell<Vec<Call>>,
}

impl Weights for Counting {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        if name == k3_layer_compute::weights::LM_HEAD {
            self.log.borrow_mut().push(Call::Head);
        }
        self.inner.tensor(name)
    }
    fn begin_layer(&self, layer: usize) -> Result<(), WeightError> {
        self.log.borrow_mut().push(Call::Begin(layer));
        Ok(())
    }
    fn end_layer(&self, layer: usize) {
        self.log.borrow_mut().push(Call::End(layer));
    }
    fn announce_experts(&self, layer: usize, ids: &[u32]) {
        self.log
            .borrow_mut()
            .push(Call::Announce(layer, ids.to_vec()));
    }
    fn experts(&self, layer: usize, ids: &[u32], deliver: &mut dyn for<'b> FnMut(Delivery<'b>)) {
        self.log
            .borrow_mut()
            .push(Call::Experts(layer, ids.to_vec()));
        self.inner.experts(layer, ids, deliver)
    }
}

fn counting(model: &str, layers: Option<usize>) -> Model<Counting> {
    let dir = fixtures().join(model);
    let cfg = ModelConfig::load_dir(&dir).unwrap();
    let w = MmapWeights::open(&dir).unwrap();
    Model::new(
        cfg,
        Counting {
            inner: SourceWeights::new(w),
            log: RefCell::new(Vec::new()),
        },
        ModelOptions {
            layers,
            ..Default::default()
        },
    )
    .unwrap()
}

fn take_log(m: &Model<Counting>) -> Vec<Call> {
    std::mem::take(&mut *m.weights().log.borrow_mut())
}

/// Per MoE layer, the distinct experts asked for (from `Experts` calls).
fn experts_by_layer(log: &[Call]) -> Vec<(usize, BTreeSet<u32>)> {
    log.iter()
        .filter_map(|c| match c {
            Call::Experts(l, ids) => Some((*l, ids.iter().copied().collect())),
            _ => None,
        })
        .collect()
}

// Catches a batch that runs group by group (layers begun, experts asked for or the lm_head
// bound once per group instead of once per pass), an expert request that is not the union
// of the groups' routes (an expert asked for twice, or one a group needs left out), and an
// announce that differs from the request that follows it.
#[test]
fn a_pass_reads_its_weights_once_for_every_group() {
    let _kernels = kernels_shared();
    for model in MODELS {
        let m = counting(model, None);
        let n = m.n_layers();
        let all = full_ids(model);
        // Four groups: three decode rows at different positions and a 4-token prompt.
        let starts = [(0usize, 6usize), (5, 9), (12, 3), (2, 0)];
        let lens = [1usize, 1, 1, 4];
        let mut sess: Vec<Session> = starts
            .iter()
            .map(|&(o, before)| fed(&m, &all[o..o + before]))
            .collect();
        // Alone, each group's experts per layer.
        let mut alone_sets: Vec<Vec<(usize, BTreeSet<u32>)>> = Vec::new();
        for (i, &(o, before)) in starts.iter().enumerate() {
            let mut s = sess[i].clone();
            take_log(&m);
            m.prefill(&mut s, &all[o + before..o + before + lens[i]])
                .unwrap();
            alone_sets.push(experts_by_layer(&take_log(&m)));
        }
        take_log(&m);
        let out = {
            let mut groups: Vec<Group<'_>> = sess
                .iter_mut()
                .zip(starts.iter().zip(lens))
                .map(|(s, (&(o, before), len))| Group {
                    session: s,
                    ids: &all[o + before..o + before + len],
                    want: Want::Last,
                })
                .collect();
            m.forward_batch(&mut groups, None).unwrap()
        };
        let log = take_log(&m);
        let begins: Vec<usize> = log
            .iter()
            .filter_map(|c| match c {
                Call::Begin(l) => Some(*l),
                _ => None,
            })
            .collect();
        assert_eq!(begins, (0..n).collect::<Vec<_>>(), "{model}: layers begun");
        let ends = log.iter().filter(|c| matches!(c, Call::End(_))).count();
        assert_eq!(ends, n, "{model}: layers ended");
        let heads = log.iter().filter(|c| matches!(c, Call::Head)).count();
        assert_eq!(heads, 1, "{model}: lm_head bound once");
        let moe_layers: Vec<usize> = (0..n).filter(|&l| m.config().is_moe(l)).collect();
        let got = experts_by_layer(&log);
        assert_eq!(
            got.iter().map(|(l, _)| *l).collect::<Vec<_>>(),
            moe_layers,
            "{model}: one expert request per MoE layer"
        );
        for (l, set) in &got {
            let union: BTreeSet<u32> = alone_sets
                .iter()
                .flat_map(|a| a.iter().filter(|(al, _)| al == l))
                .flat_map(|(_, s)| s.iter().copied())
                .collect();
            assert_eq!(
                set, &union,
                "{model} layer {l}: the union of the groups' routes"
            );
        }
        // Each expert request is announced first, with the same ids in the same order.
        for (k, c) in log.iter().enumerate() {
            if let Call::Experts(l, ids) = c {
                assert!(
                    log[..k].contains(&Call::Announce(*l, ids.clone())),
                    "{model} layer {l}: not announced"
                );
            }
        }
        assert_eq!(
            out.stats.expert_requests,
            got.iter().map(|(_, s)| s.len()).sum::<usize>()
        );
    }
}

/// What the last bound layer of a model cut to `layers` is, for the messages.
fn last_layer(m: &Model<Counting>) -> String {
    let l = m.n_layers() - 1;
    let c = m.config();
    format!(
        "last layer {l} {:?} {}",
        c.layer_kind(l),
        if c.is_moe(l) { "MoE" } else { "dense" }
    )
}

// Catches (issue 32): a skip that changes the wanted row (the wrong row kept, a row's
// attention output taken from another row, the final mix reading a bank row of another
// token), a skip that leaves the caches short of the skipped rows (the MLA latent/keys/values
// or the KDA state and conv tails not written for them: every later step differs from
// teacher forcing), a skip that still reads the skipped rows' experts, a skip when every
// row is wanted or a trace records, and counters that do not say what was skipped.
// The last layer is MLA + MoE (whole models), KDA + MoE (12 layers) and KDA + dense (1).
#[test]
fn dead_prompt_rows_skip_the_last_layer_and_change_no_bit() {
    let _kernels = kernels_shared();
    for model in MODELS {
        let all = full_ids(model);
        let (prompt, rest) = all.split_at(9);
        for layers in [None, Some(12), Some(1)] {
            let m = counting(model, layers);
            let what = format!("{model} layers {layers:?} ({})", last_layer(&m));
            let n = m.n_layers();
            let last = n - 1;
            let moe = m.config().is_moe(last);
            let k = m.config().num_experts_per_token;
            let v = m.vocab();
            // Teacher forcing over the whole sequence: every row wanted, nothing skipped.
            take_log(&m);
            let tf = m.forward_all(&all).unwrap();
            assert_eq!(tf.stats.rows_skipped, 0, "{what}: all rows wanted");
            let tf_log = take_log(&m);
            // The prompt in one pass wanting its last row.
            let mut s = m.new_session();
            let out = m.prefill(&mut s, prompt).unwrap();
            let log = take_log(&m);
            assert_eq!(
                out.stats.rows_skipped,
                prompt.len() - 1,
                "{what}: rows skipped"
            );
            assert_eq!(
                out.stats.routes_skipped,
                if moe { (prompt.len() - 1) * k } else { 0 },
                "{what}: routes skipped"
            );
            let row = |i: usize| &tf.logits[i * v..(i + 1) * v];
            assert_bits_eq(&format!("{what}: prompt logits"), &out.logits, row(8));
            if moe {
                // The last layer asks only for the last row's experts; the layers before
                // ask for every row's (as teacher forcing over the prompt does).
                let asked = experts_by_layer(&log);
                let (l, last_set) = asked.last().unwrap();
                assert_eq!(*l, last, "{what}");
                assert!(last_set.len() <= k, "{what}: {last_set:?} for one row");
                assert!(
                    out.stats.expert_requests
                        < experts_by_layer(&tf_log)
                            .iter()
                            .map(|(_, s)| s.len())
                            .sum::<usize>(),
                    "{what}: fewer experts read"
                );
            }
            // Every later step: the teacher-forced row, bit for bit (the caches hold the
            // skipped rows).
            for (j, &t) in rest.iter().enumerate().take(6) {
                let o = m.step(&mut s, t).unwrap();
                assert_eq!(o.stats.rows_skipped, 0, "{what}: a decode row is wanted");
                assert_bits_eq(&format!("{what}: step {j}"), &o.logits, row(9 + j));
            }
            // In passes of 4: the passes before the last skip every row of theirs.
            let mut s = m.new_session();
            let out = m.prefill_chunked(&mut s, prompt, Some(4)).unwrap();
            assert_eq!(out.stats.rows_skipped, prompt.len() - 1, "{what}: chunked");
            assert_bits_eq(&format!("{what}: chunked"), &out.logits, row(8));
            let o = m.step(&mut s, rest[0]).unwrap();
            assert_bits_eq(&format!("{what}: chunked, step 0"), &o.logits, row(9));
            // A trace records every row: nothing is skipped.
            let mut trace = k3_layer_compute::modules::Trace::default();
            let mut s = m.new_session();
            let o = m.forward(&mut s, prompt, false, Some(&mut trace)).unwrap();
            assert_eq!(o.stats.rows_skipped, 0, "{what}: traced");
            assert_bits_eq(&format!("{what}: traced"), &o.logits, row(8));
            let outs = trace
                .arrays
                .get(&format!("L{last:02}.out"))
                .expect("the last layer's output is traced");
            assert_eq!(outs.len(), prompt.len() * m.config().hidden_size);
        }
    }
}
