//! VMI -> QEMU argv: the converter never panics, and every argv it renders parses as QEMU
//! parses it (`kubevirt_rs_fuzz::argv`), for the VMI as sent and after KubeVirt's defaults.
#![no_main]

use kubevirt_rs_fuzz::{check_conversion, vmi};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(mut vmi) = vmi::from_input(data) else {
        return;
    };
    check_conversion(&vmi);
    if api::defaults::apply_vmi(&mut vmi, &api::ClusterConfig::default()).is_ok() {
        check_conversion(&vmi);
    }
});
