//! `k3-orch chat`'s saved sessions at the state-file level (`state::encode_prefix` /
//! `state::decode_prefix`) on the tiny-mxfp4 fixture: the kept state for the longest proper
//! prefix of a conversation goes to a state file and comes back bit for bit (the rest of the
//! conversation prefilled on the loaded state gives the logits the kept state gives), and a
//! file for another model, another conversation or with a changed byte is refused.

use crate::support::*;
use k3_layer_compute::decode::PrefixCache;
use k3_layer_compute::state::{decode_prefix, encode_prefix, StateError};

/// Catches: a state saved with the wrong key (the whole conversation, or the shorter kept
/// entry), a pending token that is not the conversation's next one, a lossy round trip
/// (logits differ bit-wise after the reload), and refusals that do not happen.
#[test]
fn a_prefix_state_round_trips_and_is_refused_where_it_does_not_fit() {
    let _kernels = kernels_shared();
    let m = load("tiny-mxfp4", 1);
    let e = read_json(&fixtures().join("tiny-mxfp4/expected-k3ref.json"));
    let prompt = ids(&e, "prompt_ids");
    assert!(prompt.len() >= 4, "{prompt:?}");
    let (short, long) = (1, prompt.len() - 2);
    // Two kept states: the longer one is the one a conversation over the whole prompt reuses.
    let mut cache = PrefixCache::new(4);
    for k in [short, long] {
        let mut s = m.new_session();
        m.prefill(&mut s, &prompt[..k]).unwrap();
        cache.insert(prompt[..k].to_vec(), s);
    }
    let (bytes, n) = encode_prefix(&mut cache, &prompt, "model-a").unwrap();
    assert_eq!(n, long);

    let (key, mut loaded) = decode_prefix(&bytes, "model-a", &m, &prompt).unwrap();
    assert_eq!(key, prompt[..long]);
    let (_, mut kept) = cache.lookup(&prompt).unwrap();
    let want = m.prefill(&mut kept, &prompt[long..]).unwrap();
    let got = m.prefill(&mut loaded, &prompt[long..]).unwrap();
    assert_bits_eq("logits after the reloaded state", &got.logits, &want.logits);

    // Another model (fingerprint).
    let err = decode_prefix(&bytes, "model-b", &m, &prompt).err().unwrap();
    assert!(matches!(err, StateError::OtherModel { .. }), "{err}");
    // Another conversation: the pending token differs, then the first token.
    let mut other = prompt.clone();
    other[long] ^= 1;
    let err = decode_prefix(&bytes, "model-a", &m, &other).err().unwrap();
    assert!(matches!(err, StateError::OtherConversation { .. }), "{err}");
    let err = decode_prefix(&bytes, "model-a", &m, &prompt[..long])
        .err()
        .unwrap();
    assert!(matches!(err, StateError::OtherConversation { .. }), "{err}");
    // One byte changed in the payload.
    let mut bad = bytes.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0x10;
    let err = decode_prefix(&bad, "model-a", &m, &prompt).err().unwrap();
    assert!(matches!(err, StateError::Checksum), "{err}");
    // Nothing kept for the conversation.
    let mut empty = PrefixCache::new(4);
    assert!(matches!(
        encode_prefix(&mut empty, &prompt, "model-a"),
        Err(StateError::NoneKept)
    ));
}
