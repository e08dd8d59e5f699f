use std::io;
use std::path::PathBuf;

/// Everything that can go wrong while reading or changing cgroups.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("writing {value:?} to {path}")]
    Write {
        path: PathBuf,
        value: String,
        #[source]
        source: io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("no cgroup filesystem is mounted according to {mountinfo}")]
    NotMounted { mountinfo: PathBuf },
    #[error("the {controller} controller is not mounted on this host")]
    ControllerMissing { controller: String },
    #[error("the process is in no cgroup of the {controller} hierarchy")]
    NotAMember { controller: String },
    #[error("device rule {index}: {message}")]
    InvalidRule { index: usize, message: String },
    #[error("cpu list {input:?}: {message}")]
    InvalidCpuList { input: String, message: String },
    #[error("creating cgroup {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("removing cgroup {path}")]
    Remove {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("moving thread {tid} into {path}")]
    MoveThread {
        tid: i32,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("bpf {op} for cgroup {path}")]
    Bpf {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the kernel verifier rejected the device program for cgroup {path}: {log}")]
    Verifier {
        path: PathBuf,
        log: String,
        #[source]
        source: io::Error,
    },
}

pub type Result<T, E = CgroupError> = std::result::Result<T, E>;
