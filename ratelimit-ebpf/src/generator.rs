//! The live-frames flood generator (`bench` feature). Filled in separately.
