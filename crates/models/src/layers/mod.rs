//! Layers shared by several architectures.

pub mod dense;
