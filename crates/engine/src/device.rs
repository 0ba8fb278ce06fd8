//! Which device a model runs on, and the user's `--device` choice (`auto`, `cpu`, `cuda`,
//! `gpu`, `cuda:N`): the backend seam's own types, re-exported because
//! [`crate::open::make_backend`] is where a choice becomes a backend.

pub use kapitsa_backend::{Device, DeviceChoice};
