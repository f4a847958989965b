//! The per-call profile line (`src/profile.rs`): phases that nest are printed, not counted
//! twice.

use k3_layer_compute::profile::*;

// Catches: `attn-core` (a part of `attn`) counted a second time, which would take it
// out of `other` and make the named phases add up to more than the call.
#[test]
fn attn_core_is_printed_but_not_counted_twice() {
    let mut ms = vec![0.0; N];
    ms[0] = 60.0; // attn
    ms[1] = 25.0; // attn-core, inside attn
    ms[N - 1] = 10.0; // trunk-wait
    let l = line(16, 100.0, &ms);
    assert!(
        l.contains(" | attn 60.0 | attn-core 25.0 | router 0.0"),
        "{l}"
    );
    assert!(l.ends_with(" | trunk-wait 10.0 | other 30.0"), "{l}");
}
