//! Facts about the MLX runtime a report records.

use mlx_rs::{Device, DeviceType};

use crate::report::Environment;

/// MLX's own version string (from the linked library, not from a pin).
pub fn mlx_version() -> String {
    // SAFETY: mlx_version fills a fresh mlx_string that we read and free here.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let version = if mlx_sys::mlx_version(&mut s) == 0 {
            let p = mlx_sys::mlx_string_data(s);
            if p.is_null() {
                String::from("unknown")
            } else {
                std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        } else {
            String::from("unknown")
        };
        mlx_sys::mlx_string_free(s);
        version
    }
}

/// `gpu` on Apple Silicon with Metal, `cpu` otherwise.
pub fn device() -> String {
    match Device::try_default().and_then(|d| d.get_type()) {
        Ok(DeviceType::Gpu) => "gpu".into(),
        _ => "cpu".into(),
    }
}

pub fn environment() -> Environment {
    Environment {
        mlx_version: mlx_version(),
        device: device(),
        os: std::env::consts::OS.into(),
        arch: std::env::consts::ARCH.into(),
    }
}
