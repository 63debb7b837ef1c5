//! Loading a probe's BPF object, with the user-memory helpers its programs were compiled
//! with.
//!
//! libbpf rewrites calls of `bpf_probe_read_user` and `bpf_probe_read_kernel` (and their
//! `_str` forms) into the old `bpf_probe_read` (`_str`) when its feature probe for
//! `bpf_probe_read_kernel` fails, meant for kernels older than 5.5. Under
//! `lockdown=confidentiality` that probe always fails (lockdown refuses kernel reads), so
//! libbpf turns every user-memory read, which lockdown allows, into `bpf_probe_read`, which
//! it refuses: the verifier then says `program of this type cannot use helper
//! bpf_probe_read#4` for a program whose source never calls it.
//!
//! Every probe therefore loads through [`load`] (clippy's `disallowed-methods` refuses a
//! direct `OpenSkel::load`): libbpf prepares the object (relocations, maps and that
//! rewrite), then each program gets back, at each call site, the helper its compiled code
//! asked for, and only then are the programs loaded. The rules that make this exact:
//! gpufeed's programs never call `bpf_probe_read`/`bpf_probe_read_str` themselves, and read
//! memory only in their own code (inlined), not in a subprogram that libbpf appends (a
//! subprogram's call sites cannot be traced back to the compiled code); a violation fails
//! the load on every kernel, so no test machine can miss it.

use libbpf_rs::skel::OpenSkel;
use libbpf_rs::AsRawLibbpf;
use libbpf_sys::bpf_insn;

use super::ProbeError;

/// Helper ids (`enum bpf_func_id`, include/uapi/linux/bpf.h), as libbpf-sys binds them.
const PROBE_READ: i32 = libbpf_sys::BPF_FUNC_probe_read as i32;
const PROBE_READ_STR: i32 = libbpf_sys::BPF_FUNC_probe_read_str as i32;

/// `BPF_JMP | BPF_CALL`.
const CALL: u8 = (libbpf_sys::BPF_JMP | libbpf_sys::BPF_CALL) as u8;

fn helper(insn: &bpf_insn) -> Option<i32> {
    (insn.code == CALL && insn.src_reg() == 0 && insn.dst_reg() == 0).then_some(insn.imm)
}

/// What libbpf turns `id` into without kernel support for the split helpers.
fn downgraded(id: i32) -> Option<i32> {
    match id as libbpf_sys::bpf_func_id {
        libbpf_sys::BPF_FUNC_probe_read_user | libbpf_sys::BPF_FUNC_probe_read_kernel => {
            Some(PROBE_READ)
        }
        libbpf_sys::BPF_FUNC_probe_read_user_str | libbpf_sys::BPF_FUNC_probe_read_kernel_str => {
            Some(PROBE_READ_STR)
        }
        _ => None,
    }
}

/// Puts back into `prepared` (a program's instructions after libbpf's preparation) the
/// helpers `compiled` (its instructions as compiled) called where libbpf downgraded them;
/// returns how many. An error names the rule broken.
pub fn restore(compiled: &[bpf_insn], prepared: &mut [bpf_insn]) -> Result<usize, String> {
    for (i, insn) in compiled.iter().enumerate() {
        if let Some(id @ (PROBE_READ | PROBE_READ_STR)) = helper(insn) {
            return Err(format!(
                "instruction {i} calls the legacy helper #{id}: use bpf_probe_read_user or \
                 bpf_probe_read_kernel (lockdown refuses the legacy one)"
            ));
        }
    }
    let mut restored = 0;
    for (i, insn) in prepared.iter_mut().enumerate() {
        let Some(now @ (PROBE_READ | PROBE_READ_STR)) = helper(insn) else {
            continue;
        };
        match compiled.get(i).and_then(helper) {
            Some(was) if downgraded(was) == Some(now) => {
                insn.imm = was;
                restored += 1;
            }
            _ => {
                return Err(format!(
                    "instruction {i} reads memory in a subprogram (helper #{now} after \
                     relocation): inline the read (__always_inline) so that its helper \
                     survives libbpf's rewrite"
                ))
            }
        }
    }
    Ok(restored)
}

/// Tests make the kernel's refusal happen on a kernel that refuses nothing: the objects
/// named in this variable (comma-separated, as passed to [`load`]) fail as a verifier's
/// EINVAL would, after everything before the load ran.
pub const REFUSE_ENV: &str = "GPUFEED_TEST_REFUSE_OBJECTS";

fn refused_by_test(probe: &str) -> bool {
    std::env::var(REFUSE_ENV).is_ok_and(|v| v.split(',').any(|o| o.trim() == probe))
}

/// Prepares, restores each program's user- and kernel-memory helpers, and loads.
#[allow(clippy::disallowed_methods)] // the one place that calls OpenSkel::load
pub fn load<'obj, S: OpenSkel<'obj>>(
    probe: &'static str,
    mut open: S,
) -> Result<S::Output, ProbeError> {
    let obj = open.open_object_mut().as_libbpf_object().as_ptr();
    let compiled = programs(obj)
        .into_iter()
        .map(|p| {
            // SAFETY: p is a program of obj, which lives while `open` does.
            unsafe { insns(p).to_vec() }
        })
        .collect::<Vec<_>>();
    // SAFETY: obj is the open object; prepare is allowed once, before load.
    let r = unsafe { libbpf_sys::bpf_object__prepare(obj) };
    if r != 0 {
        return Err(ProbeError::Libbpf {
            probe,
            what: "prepare",
            source: libbpf_rs::Error::from_raw_os_error(-r),
        });
    }
    for (prog, compiled) in programs(obj).into_iter().zip(&compiled) {
        // SAFETY: as above; the object is prepared, not loaded, so its programs'
        // instructions may still be replaced.
        let mut prepared = unsafe { insns(prog).to_vec() };
        let restored = restore(compiled, &mut prepared).map_err(|why| ProbeError::Rule {
            probe,
            program: program_name(prog),
            why,
        })?;
        if restored > 0 {
            // SAFETY: set_insns copies the instructions into libbpf's own buffer.
            let r = unsafe {
                libbpf_sys::bpf_program__set_insns(prog, prepared.as_mut_ptr(), prepared.len() as _)
            };
            if r != 0 {
                return Err(ProbeError::Libbpf {
                    probe,
                    what: "restore helpers",
                    source: libbpf_rs::Error::from_raw_os_error(-r),
                });
            }
        }
    }
    if refused_by_test(probe) {
        return Err(ProbeError::Libbpf {
            probe,
            what: "load",
            source: libbpf_rs::Error::from_raw_os_error(libc::EINVAL),
        });
    }
    open.load().map_err(super::err(probe, "load"))
}

fn programs(obj: *mut libbpf_sys::bpf_object) -> Vec<*mut libbpf_sys::bpf_program> {
    let mut out = Vec::new();
    let mut p = std::ptr::null_mut();
    loop {
        // SAFETY: iterating the object's programs; NULL starts and ends the walk.
        p = unsafe { libbpf_sys::bpf_object__next_program(obj, p) };
        if p.is_null() {
            return out;
        }
        out.push(p);
    }
}

/// # Safety
/// `prog` is a live program; the slice is valid until its instructions change.
unsafe fn insns<'a>(prog: *mut libbpf_sys::bpf_program) -> &'a [bpf_insn] {
    // SAFETY: per the function's contract.
    unsafe {
        let n = libbpf_sys::bpf_program__insn_cnt(prog) as usize;
        let p = libbpf_sys::bpf_program__insns(prog);
        if p.is_null() || n == 0 {
            return &[];
        }
        std::slice::from_raw_parts(p, n)
    }
}

fn program_name(prog: *mut libbpf_sys::bpf_program) -> String {
    // SAFETY: bpf_program__name never returns NULL for a live program.
    unsafe { std::ffi::CStr::from_ptr(libbpf_sys::bpf_program__name(prog)) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROBE_READ_USER: i32 = libbpf_sys::BPF_FUNC_probe_read_user as i32;
    const PROBE_READ_KERNEL: i32 = libbpf_sys::BPF_FUNC_probe_read_kernel as i32;
    const PROBE_READ_USER_STR: i32 = libbpf_sys::BPF_FUNC_probe_read_user_str as i32;

    fn call(id: i32) -> bpf_insn {
        bpf_insn {
            code: CALL,
            imm: id,
            ..Default::default()
        }
    }

    fn mov() -> bpf_insn {
        bpf_insn {
            code: 0xb7, // BPF_ALU64 | BPF_MOV | BPF_K
            imm: 8,
            ..Default::default()
        }
    }

    #[test]
    fn downgraded_helpers_get_back_what_was_compiled() {
        let compiled = [
            mov(),
            call(PROBE_READ_USER),
            mov(),
            call(PROBE_READ_USER_STR),
            call(1),
        ];
        let mut prepared = [
            mov(),
            call(PROBE_READ),
            mov(),
            call(PROBE_READ_STR),
            call(1),
        ];
        assert_eq!(restore(&compiled, &mut prepared), Ok(2));
        assert_eq!(prepared[1].imm, PROBE_READ_USER);
        assert_eq!(prepared[3].imm, PROBE_READ_USER_STR);
        assert_eq!(prepared[4].imm, 1);
        // a kernel read is put back as a kernel read (lockdown then refuses it by name)
        let mut k = [call(PROBE_READ)];
        assert_eq!(restore(&[call(PROBE_READ_KERNEL)], &mut k), Ok(1));
        assert_eq!(k[0].imm, PROBE_READ_KERNEL);
        // nothing downgraded: nothing changed
        let mut same = compiled;
        assert_eq!(restore(&compiled, &mut same), Ok(0));
        assert_eq!(same[1].imm, PROBE_READ_USER);
    }

    #[test]
    fn the_rules_are_enforced() {
        // the legacy helper in the compiled code
        let e = restore(&[call(PROBE_READ)], &mut [call(PROBE_READ)]).unwrap_err();
        assert!(e.contains("legacy helper #4"), "{e}");
        // a downgraded read past the program's own code: a subprogram appended by libbpf
        let e = restore(&[mov()], &mut [mov(), call(PROBE_READ)]).unwrap_err();
        assert!(e.contains("subprogram"), "{e}");
        // a string read downgraded to the plain one cannot be the compiled helper
        let e = restore(&[call(PROBE_READ_USER_STR)], &mut [call(PROBE_READ)]).unwrap_err();
        assert!(e.contains("subprogram"), "{e}");
    }
}
