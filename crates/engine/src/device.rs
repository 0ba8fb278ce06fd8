//! Which device a model runs on, and the user's `--device` choice (`auto`, `cpu`, `cuda`,
//! `gpu`, `cuda:N`).
//!
//! These mirror `kapitsa_backend::{Device, DeviceChoice}` of the device-neutral backend seam
//! (same variants, same parsing) and will be replaced by them when that seam lands; until
//! then the engine owns them because [`crate::open::make_backend`] is where a choice becomes a
//! backend.

use crate::EngineError;

/// A device a backend runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host CPU.
    Cpu,
    /// CUDA device `n`.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// What the user asked for with `--device`: a usable GPU if there is one, else the CPU
/// (`auto`, the default), or one device exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// A usable GPU if there is one, else the CPU.
    #[default]
    Auto,
    /// A specific device.
    Exact(Device),
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Auto => write!(f, "auto"),
            DeviceChoice::Exact(d) => d.fmt(f),
        }
    }
}

impl std::str::FromStr for DeviceChoice {
    type Err = EngineError;

    /// `auto`, `cpu`, `cuda` / `gpu` (device 0) or `cuda:N`; anything else is
    /// [`EngineError::Device`] naming the accepted values.
    fn from_str(s: &str) -> Result<DeviceChoice, EngineError> {
        let bad = || {
            EngineError::Device(format!(
                "unknown device '{s}' (use cpu, cuda, cuda:N or auto)"
            ))
        };
        Ok(match s {
            "auto" => DeviceChoice::Auto,
            "cpu" => DeviceChoice::Exact(Device::Cpu),
            "cuda" | "gpu" => DeviceChoice::Exact(Device::Cuda(0)),
            other => {
                let n = other.strip_prefix("cuda:").ok_or_else(bad)?;
                DeviceChoice::Exact(Device::Cuda(n.parse().map_err(|_| bad())?))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_devices() {
        let p = |s: &str| s.parse::<DeviceChoice>();
        assert_eq!(p("auto").unwrap(), DeviceChoice::Auto);
        assert_eq!(p("cpu").unwrap(), DeviceChoice::Exact(Device::Cpu));
        assert_eq!(p("cuda").unwrap(), DeviceChoice::Exact(Device::Cuda(0)));
        assert_eq!(p("gpu").unwrap(), DeviceChoice::Exact(Device::Cuda(0)));
        assert_eq!(p("cuda:3").unwrap(), DeviceChoice::Exact(Device::Cuda(3)));
        for bad in ["", "cuda:", "cuda:x", "tpu", "cuda:-1", "CPU"] {
            let e = p(bad).unwrap_err().to_string();
            assert!(e.contains("unknown device"), "{bad}: {e}");
            assert!(e.contains(&format!("'{bad}'")), "{bad}: {e}");
        }
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        assert_eq!(DeviceChoice::default(), DeviceChoice::Auto);
        for s in ["auto", "cpu", "cuda:0", "cuda:2"] {
            assert_eq!(p(s).unwrap().to_string(), s);
        }
    }
}
