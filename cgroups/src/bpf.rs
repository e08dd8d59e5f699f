//! The cgroup2 device filter: an eBPF program of type `BPF_PROG_TYPE_CGROUP_DEVICE` generated
//! from an allow list, and the few bpf(2) commands needed to load, attach, query and detach it.
//!
//! Hand-assembled because the program is tiny and fixed in shape (a chain of compare-and-jump
//! blocks) and the alternatives (aya, libbpf-rs) bring an ELF loader or a C toolchain for
//! nothing this needs. `tests::run` below is a reference interpreter for the instructions the
//! generator emits; property tests hold the program to [`crate::devices::permits`].

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use crate::devices::{Access, DeviceEntry, DeviceKind};

/// One eBPF instruction, laid out as the kernel's `struct bpf_insn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Insn {
    pub code: u8,
    /// dst register in the low nibble, src register in the high nibble.
    pub regs: u8,
    pub off: i16,
    pub imm: i32,
}

// Opcodes (class | op | source) from linux/bpf_common.h and linux/bpf.h.
const LDX_MEM_W: u8 = 0x61;
const ALU64_MOV_K: u8 = 0xb7;
const ALU64_MOV_X: u8 = 0xbf;
const ALU64_AND_K: u8 = 0x57;
const ALU64_RSH_K: u8 = 0x77;
const JMP_JNE_K: u8 = 0x55;
const JMP_JNE_X: u8 = 0x5d;
const JMP_EXIT: u8 = 0x95;

// `struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }`, where access_type
// is `access << 16 | type`.
const CTX_ACCESS_TYPE: i16 = 0;
const CTX_MAJOR: i16 = 4;
const CTX_MINOR: i16 = 8;
const DEVCG_DEV_BLOCK: i32 = 1;
const DEVCG_DEV_CHAR: i32 = 2;

const R0: u8 = 0;
const R1: u8 = 1;
const R2: u8 = 2;
const R3: u8 = 3;
const R4: u8 = 4;
const R5: u8 = 5;

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: dst | (src << 4),
        off,
        imm,
    }
}

/// The filter for an allow list: 1 (allow) when some entry covers the request, else 0.
///
/// Registers after the prologue: r2 = device type, r3 = requested access bits, r4 = major,
/// r5 = minor. Each entry is one block whose failing comparisons jump to the next block.
pub fn device_program(entries: &[DeviceEntry]) -> Vec<Insn> {
    let mut prog = vec![
        insn(LDX_MEM_W, R2, R1, CTX_ACCESS_TYPE, 0),
        insn(ALU64_AND_K, R2, 0, 0, 0xffff),
        insn(LDX_MEM_W, R3, R1, CTX_ACCESS_TYPE, 0),
        insn(ALU64_RSH_K, R3, 0, 0, 16),
        insn(LDX_MEM_W, R4, R1, CTX_MAJOR, 0),
        insn(LDX_MEM_W, R5, R1, CTX_MINOR, 0),
    ];
    for entry in entries {
        let mut block = Vec::with_capacity(8);
        match entry.kind {
            DeviceKind::Char => block.push(insn(JMP_JNE_K, R2, 0, 0, DEVCG_DEV_CHAR)),
            DeviceKind::Block => block.push(insn(JMP_JNE_K, R2, 0, 0, DEVCG_DEV_BLOCK)),
            // `effective` never yields All; matching any type needs no comparison.
            DeviceKind::All => {}
        }
        if entry.access != Access::ALL {
            // Every requested bit must be granted: (requested & granted) == requested.
            block.push(insn(ALU64_MOV_X, R1, R3, 0, 0));
            block.push(insn(ALU64_AND_K, R1, 0, 0, i32::from(entry.access.bits())));
            block.push(insn(JMP_JNE_X, R1, R3, 0, 0));
        }
        if let Some(major) = entry.major {
            block.push(insn(JMP_JNE_K, R4, 0, 0, imm(major)));
        }
        if let Some(minor) = entry.minor {
            block.push(insn(JMP_JNE_K, R5, 0, 0, imm(minor)));
        }
        block.push(insn(ALU64_MOV_K, R0, 0, 0, 1));
        block.push(insn(JMP_EXIT, 0, 0, 0, 0));
        let len = block.len();
        for (i, ins) in block.iter_mut().enumerate() {
            if ins.code == JMP_JNE_K || ins.code == JMP_JNE_X {
                // Skip the rest of the block: offsets count from the next instruction.
                ins.off = i16::try_from(len - i - 1).expect("a block is a handful of insns");
            }
        }
        prog.extend(block);
    }
    prog.push(insn(ALU64_MOV_K, R0, 0, 0, 0));
    prog.push(insn(JMP_EXIT, 0, 0, 0, 0));
    prog
}

fn imm(n: u32) -> i32 {
    // Device numbers are validated to 20 bits by `effective`.
    i32::try_from(n).expect("device numbers fit in 20 bits")
}

// bpf(2) commands, program and attach types, flags (linux/bpf.h).
const BPF_PROG_LOAD: libc::c_int = 5;
const BPF_PROG_ATTACH: libc::c_int = 8;
const BPF_PROG_DETACH: libc::c_int = 9;
const BPF_PROG_GET_FD_BY_ID: libc::c_int = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_int = 15;
const BPF_PROG_QUERY: libc::c_int = 16;
const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
/// Lets several programs sit on one cgroup; a request must pass all of them. This is what
/// makes replace-without-a-gap possible, and what runc and crun use too.
pub const BPF_F_ALLOW_MULTI: u32 = 2;

#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
}

#[repr(C)]
#[derive(Default)]
struct AttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
}

#[repr(C)]
#[derive(Default)]
struct QueryAttr {
    target_fd: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Default)]
struct GetFdByIdAttr {
    prog_id: u32,
    next_id: u32,
    open_flags: u32,
}

#[repr(C)]
#[derive(Default)]
struct InfoByFdAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The head of `struct bpf_prog_info`; the kernel fills only as much as we pass.
#[repr(C)]
#[derive(Default)]
struct ProgInfoHead {
    prog_type: u32,
    id: u32,
}

fn bpf<T>(cmd: libc::c_int, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, properly sized #[repr(C)] prefix of `union bpf_attr`; the
    // kernel reads/writes at most size_of::<T>() bytes of it, and every pointer stored in
    // it points to memory the caller keeps alive across this call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr).cast::<libc::c_void>(),
            size_of::<T>(),
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn fd_u32(fd: BorrowedFd<'_>) -> u32 {
    u32::try_from(fd.as_raw_fd()).expect("file descriptors are non-negative")
}

fn owned(fd: libc::c_long) -> OwnedFd {
    let raw = RawFd::try_from(fd).expect("bpf returns an int file descriptor");
    // SAFETY: the kernel just returned this new descriptor to us; nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(raw) }
}

/// Why a load failed: the error, and the verifier's log when there is one.
#[derive(Debug)]
pub struct LoadError {
    pub error: io::Error,
    pub log: String,
}

/// Loads a device program. On failure the load is retried with the verifier log on, so the
/// error says why.
pub fn load_device_program(prog: &[Insn]) -> Result<OwnedFd, LoadError> {
    let license = c"Apache-2.0";
    let mut name = [0u8; 16];
    name[..12].copy_from_slice(b"kubevirt_dev");
    let mut attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_CGROUP_DEVICE,
        insn_cnt: u32::try_from(prog.len()).expect("programs stay far below 4G instructions"),
        insns: prog.as_ptr() as u64,
        license: license.as_ptr() as u64,
        prog_name: name,
        ..ProgLoadAttr::default()
    };
    match bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => Ok(owned(fd)),
        Err(error) => {
            let mut log = vec![0u8; 64 * 1024];
            attr.log_level = 1;
            attr.log_size = u32::try_from(log.len()).expect("64 KiB fits");
            attr.log_buf = log.as_mut_ptr() as u64;
            if let Ok(fd) = bpf(BPF_PROG_LOAD, &mut attr) {
                // Passed with logging on: keep it rather than fail on a transient error.
                return Ok(owned(fd));
            }
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            Err(LoadError {
                error,
                log: String::from_utf8_lossy(&log[..end]).trim().to_owned(),
            })
        }
    }
}

/// The kernel's id of a loaded program.
pub fn program_id(prog: BorrowedFd<'_>) -> io::Result<u32> {
    let mut info = ProgInfoHead::default();
    let mut attr = InfoByFdAttr {
        bpf_fd: fd_u32(prog),
        info_len: u32::try_from(size_of::<ProgInfoHead>()).expect("8 bytes"),
        info: std::ptr::from_mut(&mut info) as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info.id)
}

/// Attaches a device program to a cgroup2 directory, next to any already there.
pub fn attach(cgroup: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = AttachAttr {
        target_fd: fd_u32(cgroup),
        attach_bpf_fd: fd_u32(prog),
        attach_type: BPF_CGROUP_DEVICE,
        attach_flags: BPF_F_ALLOW_MULTI,
    };
    bpf(BPF_PROG_ATTACH, &mut attr).map(drop)
}

/// Detaches one device program from a cgroup2 directory.
pub fn detach(cgroup: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = AttachAttr {
        target_fd: fd_u32(cgroup),
        attach_bpf_fd: fd_u32(prog),
        attach_type: BPF_CGROUP_DEVICE,
        attach_flags: 0,
    };
    bpf(BPF_PROG_DETACH, &mut attr).map(drop)
}

/// Ids of the device programs attached directly to a cgroup2 directory.
pub fn query(cgroup: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    let mut ids = vec![0u32; 64];
    loop {
        let mut attr = QueryAttr {
            target_fd: fd_u32(cgroup),
            attach_type: BPF_CGROUP_DEVICE,
            prog_ids: ids.as_mut_ptr() as u64,
            prog_cnt: u32::try_from(ids.len()).expect("small"),
            ..QueryAttr::default()
        };
        match bpf(BPF_PROG_QUERY, &mut attr) {
            Ok(_) => {
                ids.truncate(attr.prog_cnt as usize);
                return Ok(ids);
            }
            // The kernel wrote the real count; make room and ask again.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                ids = vec![0; attr.prog_cnt as usize];
            }
            Err(e) => return Err(e),
        }
    }
}

/// A descriptor for a loaded program by id (`ENOENT` once the kernel has freed it).
pub fn program_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut attr = GetFdByIdAttr {
        prog_id: id,
        ..GetFdByIdAttr::default()
    };
    bpf(BPF_PROG_GET_FD_BY_ID, &mut attr).map(owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::tests::arb_rule;
    use crate::devices::{effective, permits};
    use proptest::prelude::*;

    /// Runs `prog` on a device request the way the kernel would, for the instructions the
    /// generator emits; anything else fails the test.
    fn run(prog: &[Insn], kind: DeviceKind, major: u32, minor: u32, access: Access) -> u64 {
        let dev_type: u32 = match kind {
            DeviceKind::Block => 1,
            DeviceKind::Char => 2,
            DeviceKind::All => unreachable!("requests are for one device"),
        };
        let ctx = [(u32::from(access.bits()) << 16) | dev_type, major, minor];
        let mut regs = [0u64; 11];
        let mut pc = 0usize;
        loop {
            let i = prog[pc];
            let (dst, src) = ((i.regs & 0xf) as usize, (i.regs >> 4) as usize);
            let imm = u64::from_ne_bytes(i64::from(i.imm).to_ne_bytes());
            pc += 1;
            match i.code {
                LDX_MEM_W => {
                    assert_eq!(src, 1, "loads only from the context");
                    regs[dst] = u64::from(ctx[usize::try_from(i.off).unwrap() / 4]);
                }
                ALU64_MOV_K => regs[dst] = imm,
                ALU64_MOV_X => regs[dst] = regs[src],
                ALU64_AND_K => regs[dst] &= imm,
                ALU64_RSH_K => regs[dst] >>= imm,
                JMP_JNE_K | JMP_JNE_X => {
                    let rhs = if i.code == JMP_JNE_K { imm } else { regs[src] };
                    if regs[dst] != rhs {
                        pc += usize::try_from(i.off).unwrap();
                    }
                }
                JMP_EXIT => return regs[0],
                other => panic!("unexpected opcode {other:#x}"),
            }
        }
    }

    #[test]
    fn empty_list_denies_everything() {
        let prog = device_program(&[]);
        assert_eq!(prog.len(), 8);
        assert_eq!(run(&prog, DeviceKind::Char, 1, 3, Access::READ), 0);
    }

    proptest! {
        #[test]
        fn program_agrees_with_the_allow_list(
            rules in prop::collection::vec(arb_rule(), 0..10),
            major in 0u32..5,
            minor in 0u32..5,
            bits in 1u8..=7,
            block in any::<bool>(),
        ) {
            let entries = effective(&rules).unwrap();
            let prog = device_program(&entries);
            let kind = if block { DeviceKind::Block } else { DeviceKind::Char };
            let access = Access::from_bits_truncate(bits);
            let want = u64::from(permits(&entries, kind, major, minor, access));
            prop_assert_eq!(run(&prog, kind, major, minor, access), want);
        }
    }

    #[test]
    fn the_kernel_verifier_accepts_generated_programs() {
        let rules = [
            crate::DeviceRule::allow(DeviceKind::Char, Some(1), Some(3), Access::ALL),
            crate::DeviceRule::allow(DeviceKind::Char, Some(1), None, Access::READ),
            crate::DeviceRule::allow(DeviceKind::Block, None, Some(7), Access::MKNOD),
        ];
        let prog = device_program(&effective(&rules).unwrap());
        let fd = load_device_program(&prog).unwrap();
        let id = program_id(std::os::fd::AsFd::as_fd(&fd)).unwrap();
        assert!(id > 0);
        let again = program_by_id(id).unwrap();
        assert_eq!(program_id(std::os::fd::AsFd::as_fd(&again)).unwrap(), id);
    }

    #[test]
    fn verifier_rejection_comes_with_its_log() {
        // Reads r6, which is never written: the verifier refuses and says why.
        let prog = [insn(ALU64_MOV_X, R0, 6, 0, 0), insn(JMP_EXIT, 0, 0, 0, 0)];
        let err = load_device_program(&prog).unwrap_err();
        assert_eq!(err.error.raw_os_error(), Some(libc::EACCES), "{err:?}");
        assert!(err.log.contains("R6 !read_ok"), "{}", err.log);
    }
}
