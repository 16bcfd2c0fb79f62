//! Names that become file names. A suite's name, its checkpoint names and prompt names end up in
//! report paths (`reports/<suite>/<checkpoint>__<scenario>.snap`), so a name like `../../x` or
//! `/etc` would write outside the reports folder. Every such name must be one plain path
//! component; [`contained`] is the second line of defence for whoever writes the file.

use std::path::{Component, Path, PathBuf};

/// Longest accepted name: well under every filesystem's 255-byte limit once a checkpoint and a
/// scenario are joined with `__` and `.snap.new` is appended.
pub const MAX_LEN: usize = 100;

/// Why `name` is not a safe file-name component, or `Ok`. Safe means: 1 to [`MAX_LEN`] ASCII
/// letters, digits, `-`, `_`, `.` or `+`, not starting with `.` (no `.`, `..` or hidden files).
/// Plain ASCII keeps report names identical on every filesystem (no case folding of accents,
/// no Unicode normalisation differences between macOS and Linux).
pub fn check_component(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("is empty".into());
    }
    if name.len() > MAX_LEN {
        return Err(format!("is {} bytes long; at most {MAX_LEN}", name.len()));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || "-_.+".contains(*c))) {
        return Err(format!("contains {c:?}; use only letters, digits, `-`, `_`, `.` and `+`"));
    }
    if name.starts_with('.') {
        return Err("starts with `.`".into());
    }
    Ok(())
}

/// `path` with `.` and `..` resolved lexically (no filesystem access), or `None` when a `..`
/// climbs above the start of a relative path.
pub fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    let mut depth = 0usize;
    for c in path.components() {
        match c {
            Component::Prefix(_) | Component::RootDir => {
                out.push(c.as_os_str());
                depth = 0;
            }
            Component::CurDir => {}
            Component::ParentDir => {
                if depth == 0 {
                    if out.has_root() {
                        continue; // `/..` is `/`
                    }
                    return None;
                }
                out.pop();
                depth -= 1;
            }
            Component::Normal(s) => {
                out.push(s);
                depth += 1;
            }
        }
    }
    Some(out)
}

/// Whether `path` stays inside `root`. Lexical first (so it holds for paths that do not exist
/// yet), then, for the longest part of `path` that exists, through the filesystem: a symlink
/// inside `root` that points elsewhere is outside.
pub fn contained(root: &Path, path: &Path) -> bool {
    let joined = if path.is_absolute() { path.to_path_buf() } else { root.join(path) };
    let (Some(root_n), Some(path_n)) = (normalize(root), normalize(&joined)) else {
        return false;
    };
    if !path_n.starts_with(&root_n) {
        return false;
    }
    let Ok(root_real) = root_n.canonicalize() else {
        // The root does not exist yet, so nothing under it can be a symlink.
        return true;
    };
    let mut existing = path_n.as_path();
    loop {
        if let Ok(real) = existing.canonicalize() {
            return real.starts_with(&root_real);
        }
        match existing.parent() {
            Some(p) => existing = p,
            None => return false,
        }
    }
}

/// A stable 64-bit name (FNV-1a) for what is too long or too free to be a file name itself
/// (compiler flags, a prompt's token ids): the same on every machine and build.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_pass_and_path_like_names_do_not() {
        for ok in ["fixtures", "Qwen3-0.6B-4bit", "tile+1", "block-1", "smollm2_135m", "a.b"] {
            assert_eq!(check_component(ok), Ok(()), "{ok}");
        }
        for bad in ["", ".", "..", "../../../x", "a/b", "a\\b", "/etc", ".hidden", "a b", "nul\0", "é"] {
            assert!(check_component(bad).is_err(), "{bad:?} must be rejected");
        }
        assert!(check_component(&"x".repeat(MAX_LEN + 1)).is_err());
    }

    #[test]
    fn lexical_normalisation_never_climbs_above_a_relative_start() {
        assert_eq!(normalize(Path::new("a/./b/../c")), Some(PathBuf::from("a/c")));
        assert_eq!(normalize(Path::new("a/../..")), None);
        assert_eq!(normalize(Path::new("/a/../../b")), Some(PathBuf::from("/b")));
    }

    /// The traversal of issue #14: a suite named `../../../x` wrote three folders above reports/.
    #[test]
    fn traversal_and_absolute_paths_are_outside_the_root() {
        let root = Path::new("/tmp/parity-names-test/reports");
        assert!(contained(root, Path::new("fixtures/a__single.snap")));
        assert!(contained(root, &root.join("fixtures/gpu/a.snap")));
        assert!(!contained(root, Path::new("../../../x/a.snap.new")));
        assert!(!contained(root, Path::new("fixtures/../../x")));
        assert!(!contained(root, Path::new("/etc/passwd")));
        assert!(!contained(root, Path::new("/tmp/parity-names-test/reports-other/x")));
    }

    #[cfg(unix)]
    #[test]
    fn a_symlink_out_of_the_root_is_outside() {
        let base = std::env::temp_dir().join(format!("parity-names-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (root, elsewhere) = (base.join("reports"), base.join("elsewhere"));
        std::fs::create_dir_all(&root).expect("root");
        std::fs::create_dir_all(&elsewhere).expect("elsewhere");
        std::os::unix::fs::symlink(&elsewhere, root.join("suite")).expect("symlink");
        assert!(!contained(&root, Path::new("suite/a.snap")));
        assert!(contained(&root, Path::new("real/a.snap")));
        let _ = std::fs::remove_dir_all(&base);
    }
}
