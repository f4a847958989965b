//! Activations: sigmoid, SiLU and SiTU-GLU.
//!
//! SiTU-GLU (Kimi K3's `hidden_act = "situ"`): for gate g and up u,
//! `a = β₁·tanh(g/β₁)·sigmoid(g)` — the sigmoid reads the UNCAPPED gate — and
//! `b = β₂·tanh(u/β₂)`, out = a·b, so |out| ≤ β₁β₂. Evaluated in f64, rounded once.

/// Logistic sigmoid in f64.
#[inline]
pub fn sigmoid64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Logistic sigmoid of an f32, rounded once.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    sigmoid64(x as f64) as f32
}

/// SiLU `z·sigmoid(z)`, rounded once.
#[inline]
pub fn silu(z: f64) -> f32 {
    (z * sigmoid64(z)) as f32
}

/// `out[i] = SiTU(gate[i], up[i])`.
pub fn situ_glu(gate: &[f32], up: &[f32], b1: f32, b2: f32, out: &mut [f32]) {
    assert_eq!(gate.len(), up.len());
    assert_eq!(gate.len(), out.len());
    let (b1, b2) = (b1 as f64, b2 as f64);
    for i in 0..out.len() {
        let g = gate[i] as f64;
        let u = up[i] as f64;
        let a = b1 * (g / b1).tanh() * sigmoid64(g);
        let b = b2 * (u / b2).tanh();
        out[i] = (a * b) as f32;
    }
}
