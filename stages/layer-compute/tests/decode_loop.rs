//! The decode loop's stop ids (issue 13, "untested paths"): generation ends right after the
//! first generated id that is a stop id, which is kept. The expected ids are the oracle's
//! (tiny-mxfp4, k3ref), cut at the first stop id by the rule; nothing comes from our own
//! output. (End to end, a tiny model can never produce the tokenizer's stop ids, which
//! follow its 3,261 ranks; so the rule is tested here, on the loop every mode runs.)
//! Also: a prompt fed in passes of a few tokens gives the oracle's ids and the very logits
//! of one pass.

use crate::support::*;
use k3_layer_compute::decode::{decode_loop, DecodeError, LoopOptions, Step, StepHooks};
use k3_layer_compute::sampler::SamplerConfig;

/// Greedy options over `prompt` (no logits dumped).
fn greedy<'a>(
    prompt: &'a [u32],
    gen: usize,
    incremental: bool,
    stop_ids: &'a [u32],
    prefill_chunk: Option<usize>,
) -> LoopOptions<'a> {
    LoopOptions {
        prompt,
        gen,
        incremental,
        sampler: SamplerConfig::default(),
        stop_ids,
        dump_logits: None,
        prefill_chunk,
    }
}

struct Count(usize);

impl StepHooks for Count {
    type Error = std::convert::Infallible;

    fn on_step(&mut self, _s: Step<'_>) -> Result<(), Self::Error> {
        self.0 += 1;
        Ok(())
    }
}

/// Catches: stop ids ignored (all 20 ids come back), the stop id dropped from the output,
/// a stop checked before sampling or against the prompt (the prompt holds none of them
/// here, but a check of `seq` instead of the new token would stop at once if it did), and
/// an off-by-one that runs one more step.
#[test]
fn stop_ids_end_generation_after_the_stop_id() {
    let _kernels = kernels_shared();
    let m = load("tiny-mxfp4", 1);
    let e = read_json(&fixtures().join("tiny-mxfp4/expected-k3ref.json"));
    let prompt = ids(&e, "prompt_ids");
    let full = ids(&e, "full_ids");
    let want = &full[prompt.len()..];
    assert_eq!(want.len(), 20);
    // Stop ids: one that first appears at generated index 5, one that never appears, and
    // one that is in the prompt but not generated before index 5.
    let stop = want[5];
    assert!(!want[..5].contains(&stop));
    let in_prompt = *prompt.iter().find(|i| !want[..=5].contains(i)).unwrap();
    let stops = [999u32, stop, in_prompt];
    for incremental in [false, true] {
        let mut hooks = Count(0);
        let got = decode_loop(
            &m,
            &greedy(&prompt, want.len(), incremental, &stops, None),
            &mut hooks,
        )
        .unwrap();
        assert_eq!(got, want[..=5], "incremental {incremental}");
        assert_eq!(hooks.0, 6, "steps run");
    }
    // Without stop ids the loop runs to the end (the oracle's 20 ids).
    let got = decode_loop(
        &m,
        &greedy(&prompt, want.len(), true, &[], None),
        &mut Count(0),
    )
    .unwrap();
    assert_eq!(got, want);
}

/// The first step's logits row and every id.
#[derive(Default)]
struct Logits(Vec<f32>);

impl StepHooks for Logits {
    type Error = std::convert::Infallible;

    fn on_step(&mut self, s: Step<'_>) -> Result<(), Self::Error> {
        if s.step == 0 {
            let v = s.out.logits.len() / s.out.rows;
            self.0 = s.out.logits[(s.out.rows - 1) * v..].to_vec();
        }
        Ok(())
    }
}

/// A prompt fed in passes of 1, 3, 5 and 7 tokens (the last pass takes the rest; only it
/// computes logits), incremental and recomputing the prefix each step, gives the oracle's
/// 20 ids (k3ref, both tiny models) and the first step's logits of one pass, bit for bit.
/// Catches a pass boundary that drops or repeats a token, positions that restart at each
/// pass (the MLA cache and the rotary phase), recurrent state not carried across passes,
/// logits taken from an earlier pass, and a last pass of the wrong length.
#[test]
fn a_prompt_in_passes_gives_the_oracle_ids_and_the_same_logits() {
    let _kernels = kernels_shared();
    for model in ["tiny-mxfp4", "tiny-seed"] {
        let m = load(model, 1);
        let e = read_json(&fixtures().join(format!("{model}/expected-k3ref.json")));
        let prompt = ids(&e, "prompt_ids");
        let full = ids(&e, "full_ids");
        let want = &full[prompt.len()..];
        assert!(
            prompt.len() > 7,
            "{model}: the prompt must span several passes"
        );
        let run = |chunk: Option<usize>, incremental: bool| {
            let mut hooks = Logits::default();
            let got = decode_loop(
                &m,
                &greedy(&prompt, want.len(), incremental, &[], chunk),
                &mut hooks,
            )
            .unwrap();
            (got, hooks.0)
        };
        let (one_ids, one_logits) = run(None, true);
        assert_eq!(one_ids, want, "{model}: one pass");
        for incremental in [true, false] {
            for chunk in [1, 3, 5, 7] {
                let (got, logits) = run(Some(chunk), incremental);
                assert_eq!(got, want, "{model} chunk {chunk} incremental {incremental}");
                assert!(
                    logits.len() == one_logits.len()
                        && logits
                            .iter()
                            .zip(&one_logits)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{model} chunk {chunk} incremental {incremental}: logits differ"
                );
            }
        }
    }
}

/// A hook whose `after_forward` fails at one step (a staged run's dead link).
struct FailsAt(usize, usize);

#[derive(Debug, PartialEq, thiserror::Error)]
#[error("link gone at step {0}")]
struct Gone(usize);

impl StepHooks for FailsAt {
    type Error = Gone;

    fn after_forward(&mut self, step: usize) -> Result<(), Gone> {
        if step == self.0 {
            return Err(Gone(step));
        }
        Ok(())
    }

    fn on_step(&mut self, _s: Step<'_>) -> Result<(), Gone> {
        self.1 += 1;
        Ok(())
    }
}

/// Catches a hook's error turned into another (a forward error, a message) on its way out
/// of the loop, so a caller could no longer tell a dead peer from a failed pass, and a loop
/// that goes on after a hook failed.
#[test]
fn a_hook_error_ends_the_loop_as_itself() {
    let _kernels = kernels_shared();
    let m = load("tiny-mxfp4", 1);
    let e = read_json(&fixtures().join("tiny-mxfp4/expected-k3ref.json"));
    let prompt = ids(&e, "prompt_ids");
    let mut hooks = FailsAt(2, 0);
    let got = decode_loop(&m, &greedy(&prompt, 5, true, &[], None), &mut hooks);
    match got {
        Err(DecodeError::Hook(g)) => assert_eq!(g, Gone(2)),
        other => panic!("expected the hook's own error, got {other:?}"),
    }
    assert_eq!(hooks.1, 2, "steps taken before the failure");
}
