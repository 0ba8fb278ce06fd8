//! The op suite every backend runs against the scalar reference (filled in by the
//! backend-cpu work; see `check_ops`).
