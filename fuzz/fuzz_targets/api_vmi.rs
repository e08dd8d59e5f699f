//! `api` defaults and validation on any VMI, as virt-api's webhooks run them: defaults never
//! panic and are idempotent (the API server may call the mutating webhook again on its own
//! output), validation never panics and gives the same answer twice.
#![no_main]

use api::ClusterConfig;
use api::defaults::apply_vmi;
use api::validation::validate_vmi;
use kubevirt_rs_fuzz::vmi;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(vmi) = vmi::from_input(data) else {
        return;
    };
    let mut live_update = ClusterConfig::default();
    live_update.vm_rollout_live_update = !live_update.vm_rollout_live_update;
    for cfg in [ClusterConfig::default(), live_update] {
        let first = validate_vmi(&vmi, &cfg);
        assert_eq!(
            first,
            validate_vmi(&vmi, &cfg),
            "validation is not deterministic"
        );
        let mut defaulted = vmi.clone();
        if apply_vmi(&mut defaulted, &cfg).is_err() {
            continue;
        }
        let mut again = defaulted.clone();
        apply_vmi(&mut again, &cfg).expect("defaults applied once apply again");
        assert_eq!(defaulted, again, "defaults are not idempotent");
        let first = validate_vmi(&defaulted, &cfg);
        assert_eq!(
            first,
            validate_vmi(&defaulted, &cfg),
            "validation is not deterministic"
        );
    }
});
