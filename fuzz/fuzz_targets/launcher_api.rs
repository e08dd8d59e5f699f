//! The launcher's command API bodies: any bytes a client sends to `PUT /v1/sync`,
//! `PUT /v1/migration/target` or `POST /v1/migration/start` are decoded as the launcher decodes
//! them; a decoded request encodes (as virt-handler's client would send it) and decodes back
//! to itself, and the VMI it carries goes through what the launcher does before touching
//! anything: conversion to a QEMU configuration and argv (`check_conversion`).
#![no_main]

use std::fmt::Debug;

use kubevirt_rs_fuzz::check_conversion;
use launcher_api::action::{Action, Body, Migrate, PrepareTarget, SyncVmi};
use libfuzzer_sys::fuzz_target;

fn decode<A: Action>(body: &[u8]) -> Option<A::Request>
where
    A::Request: PartialEq + Debug,
{
    let request = A::Request::decode(body).ok()?;
    let sent = request
        .encode()
        .expect("a decoded request encodes")
        .expect("a request with a body");
    let received = A::Request::decode(&sent).expect("an encoded request decodes");
    assert_eq!(received, request, "{} changed on the wire", A::PATH);
    Some(request)
}

fuzz_target!(|body: &[u8]| {
    if let Some(vmi) = decode::<SyncVmi>(body) {
        check_conversion(&vmi);
    }
    if let Some(target) = decode::<PrepareTarget>(body) {
        check_conversion(&target.vmi);
    }
    decode::<Migrate>(body);
});
