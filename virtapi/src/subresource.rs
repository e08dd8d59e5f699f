//! The subresource API under `/apis/subresources.kubevirt.io/{v1,v1alpha3}`: every request is
//! authenticated from the aggregation layer's headers, authorized by a SubjectAccessReview
//! (KubeVirt's authorizer), then served: VMI streams and actions are relayed to the handler of
//! the VMI's node, VM lifecycle requests become patches of the VM, `migrate` creates a
//! VirtualMachineInstanceMigration, `addvolume` and `removevolume` patch the VM's template or
//! the VMI's spec.

use std::sync::Arc;

use api::status::{VirtualMachineInstanceConditionType as Cond, VirtualMachineInstancePhase};
use api::subresources::{
    self as sr, AddVolumeOptions, DRY_RUN_ALL, FreezeUnfreezeTimeout, MigrateOptions, PauseOptions,
    RemoveVolumeOptions, RestartOptions, StartOptions, StopOptions, VmSubresource, VmiSubresource,
};
use api::{ConditionStatus, KubeVirt, VirtualMachine, VirtualMachineInstance};
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes as SarAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::reflector::Store;
use kube::{Api, Client};
use serde_json::Value;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

use crate::admission::HotplugGates;
use crate::authn::{self, Denied, Peer, RequestHeaderConfig, ResourceAttributes, Target, User};
use crate::lifecycle::{self, Call};
use crate::status::Refusal;
use crate::virthandler::{Handlers, handler_message};
use crate::volumes::{self, VolumeRequest};
use crate::webhooks;

/// The largest request body virt-api reads (options objects are small).
const MAX_BODY: usize = 1024 * 1024;
/// Each direction's copy buffer of a relayed stream: a read returns what TLS decrypted (up to
/// a 16 KiB record), so a larger buffer mostly lets bulk output go out in fewer writes.
const RELAY_BUFFER: usize = 64 * 1024;

pub struct App {
    pub client: Client,
    pub request_headers: std::sync::RwLock<RequestHeaderConfig>,
    pub handlers: Handlers,
    /// The KubeVirt CRs, for the feature gates, and virt-api's namespace, which picks the one.
    pub kubevirts: Store<KubeVirt>,
    pub namespace: String,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App").finish_non_exhaustive()
    }
}

impl App {
    fn request_headers(&self) -> RequestHeaderConfig {
        self.request_headers
            .read()
            .expect("request header config lock poisoned")
            .clone()
    }

    fn hotplug_gates(&self) -> HotplugGates {
        webhooks::context(&self.kubevirts, &self.namespace).hotplug
    }
}

/// Serves one request under `/apis/subresources.kubevirt.io/...` that is not discovery.
pub async fn serve(app: Arc<App>, req: Request<Body>) -> Response {
    match Box::pin(serve_inner(&app, req)).await {
        Ok(r) => r,
        Err(refusal) => {
            tracing::debug!(code = %refusal.code, message = %refusal.message, "request refused");
            refusal.into_response()
        }
    }
}

async fn serve_inner(app: &App, req: Request<Body>) -> Result<Response, Refusal> {
    let (target, attrs) = authn::parse(req.method(), req.uri().path()).map_err(|e| match e {
        Denied::Unknown(m) => Refusal {
            code: StatusCode::NOT_FOUND,
            reason: "NotFound",
            message: m,
        },
        Denied::Unauthenticated(m) => Refusal::unauthorized(m),
    })?;
    let peer = req.extensions().get::<Peer>().cloned().unwrap_or_default();
    let user = authn::user(&app.request_headers(), &peer, req.headers())
        .map_err(|e| Refusal::unauthorized(e.to_string()))?;
    authorize(&app.client, &user, &attrs).await?;
    let expected = match &target {
        Target::Vmi { sub, .. } => sub.method(),
        Target::Vm { sub, .. } => sub.method(),
    };
    if req.method().as_str() != expected {
        return Err(Refusal {
            code: StatusCode::METHOD_NOT_ALLOWED,
            reason: "MethodNotAllowed",
            message: format!(
                "{} is served on {expected}, not {}",
                attrs.subresource,
                req.method()
            ),
        });
    }
    match target {
        Target::Vmi {
            namespace,
            name,
            sub,
            rest,
        } => vmi_subresource(app, req, &namespace, &name, sub, &rest).await,
        Target::Vm {
            namespace,
            name,
            sub,
            rest,
        } => vm_subresource(app, req, &namespace, &name, sub, &rest).await,
    }
}

/// KubeVirt's authorizer: a SubjectAccessReview for the user and the subresource.
async fn authorize(client: &Client, user: &User, a: &ResourceAttributes) -> Result<(), Refusal> {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.name.clone()),
            groups: Some(user.groups.clone()),
            extra: (!user.extra.is_empty()).then(|| user.extra.clone()),
            resource_attributes: Some(SarAttributes {
                namespace: Some(a.namespace.clone()),
                verb: Some(a.verb.clone()),
                group: Some(a.group.clone()),
                version: Some(a.version.clone()),
                resource: Some(a.resource.clone()),
                subresource: Some(a.subresource.clone()),
                name: Some(a.name.clone()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| Refusal::internal(format!("authorizing the request: {e}")))?;
    let status = answer.status.unwrap_or_default();
    if status.allowed {
        return Ok(());
    }
    // The API server's wording for a denied request, so kubectl users recognise it.
    let mut message = format!(
        "User {:?} cannot {} resource \"{}/{}\" in API group {:?} in the namespace {:?}",
        user.name, a.verb, a.resource, a.subresource, a.group, a.namespace
    );
    if let Some(reason) = status.reason.filter(|r| !r.is_empty()) {
        message.push_str(": ");
        message.push_str(&reason);
    }
    Err(Refusal::forbidden(message))
}

async fn body_of<T: serde::de::DeserializeOwned + Default>(
    req: Request<Body>,
) -> Result<T, Refusal> {
    let bytes = axum::body::to_bytes(req.into_body(), MAX_BODY)
        .await
        .map_err(|e| Refusal::bad_request(format!("reading the request body: {e}")))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        Refusal::bad_request(format!(
            "Can not unmarshal Request body to struct, error: {e}"
        ))
    })
}

fn dry_run(list: &[String]) -> Result<bool, Refusal> {
    match list {
        [] => Ok(false),
        [one] if one == DRY_RUN_ALL => Ok(true),
        other => Err(Refusal::bad_request(format!(
            "invalid dry run directive {other:?}: only {DRY_RUN_ALL:?} is supported"
        ))),
    }
}

fn condition(vmi: &VirtualMachineInstance, t: &Cond) -> bool {
    vmi.status
        .as_ref()
        .and_then(|s| s.condition(t))
        .is_some_and(|c| c.status == ConditionStatus::True)
}

fn running(vmi: &VirtualMachineInstance) -> bool {
    vmi.phase() == Some(&VirtualMachineInstancePhase::Running)
}

/// KubeVirt's checks before relaying to the handler, with its messages.
fn precheck(vmi: &VirtualMachineInstance, sub: VmiSubresource) -> Result<(), Refusal> {
    let name = vmi.metadata.name.as_deref().unwrap_or_default();
    let conflict = |why: &str| Refusal::conflict("virtualmachineinstance", name, why);
    match sub {
        VmiSubresource::Pause => {
            if !running(vmi) {
                return Err(conflict(lifecycle::VM_NOT_RUNNING));
            }
            if vmi
                .spec
                .liveness_probe
                .as_ref()
                .is_some_and(|p| p.guest_agent_ping.is_none())
            {
                return Err(Refusal::forbidden_object(
                    "virtualmachineinstance",
                    name,
                    "Pausing VMIs with a non-GuestAgentPing LivenessProbe is not supported",
                ));
            }
            if condition(vmi, &Cond::Paused) {
                return Err(conflict("VMI is already paused"));
            }
        }
        VmiSubresource::Unpause => {
            if !running(vmi) {
                return Err(conflict("VMI is not running"));
            }
            if !condition(vmi, &Cond::Paused) {
                return Err(conflict("VMI is not paused"));
            }
        }
        VmiSubresource::SoftReboot => {
            if !running(vmi) {
                return Err(conflict(lifecycle::VM_NOT_RUNNING));
            }
            if condition(vmi, &Cond::Paused) {
                return Err(conflict("VMI is paused"));
            }
        }
        // KubeVirt's `validateVMIForPortForward`; the handler answers 409 for a VMI not running.
        VmiSubresource::PortForward => {
            if !running(vmi) {
                return Err(conflict("VMI is not running"));
            }
            if condition(vmi, &Cond::Paused) {
                return Err(conflict("VMI is paused"));
            }
        }
        VmiSubresource::GuestOsInfo | VmiSubresource::UserList | VmiSubresource::FilesystemList => {
            if !condition(vmi, &Cond::AgentConnected) {
                return Err(conflict("VMI does not have guest agent connected"));
            }
        }
        _ => {
            if !running(vmi) {
                return Err(conflict("VMI is not running"));
            }
        }
    }
    Ok(())
}

async fn get_vmi(client: &Client, ns: &str, name: &str) -> Result<VirtualMachineInstance, Refusal> {
    Api::<VirtualMachineInstance>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(|e| Refusal::internal(format!("unable to retrieve vmi [{name}]: {e}")))?
        .ok_or_else(|| Refusal::not_found("virtualmachineinstance", name))
}

async fn vmi_subresource(
    app: &App,
    req: Request<Body>,
    ns: &str,
    name: &str,
    sub: VmiSubresource,
    rest: &[String],
) -> Result<Response, Refusal> {
    match sub {
        VmiSubresource::AddVolume => return hotplug_volume(app, req, ns, name, false, true).await,
        VmiSubresource::RemoveVolume => {
            return hotplug_volume(app, req, ns, name, false, false).await;
        }
        _ => {}
    }
    if sub == VmiSubresource::PortForward {
        let forward = parse_port_forward(rest)?;
        let vmi = get_vmi(&app.client, ns, name).await?;
        return Box::pin(port_forward(app, req, ns, &vmi, forward)).await;
    }
    let vmi = get_vmi(&app.client, ns, name).await?;
    precheck(&vmi, sub)?;
    let node = node_of(&vmi, name)?;
    let handler_path = format!(
        "/v1/namespaces/{ns}/virtualmachineinstances/{name}/{}",
        sub.as_str()
    );
    if sub.is_stream() {
        return stream(app, req, &node, &handler_path).await;
    }
    let query = req.uri().query().map(str::to_owned);
    let method = req.method().clone();
    let body: Bytes = match sub {
        VmiSubresource::Pause | VmiSubresource::Unpause => {
            let opts: PauseOptions = body_of(req).await?;
            if dry_run(&opts.dry_run)? {
                return Ok(StatusCode::OK.into_response());
            }
            Bytes::new()
        }
        VmiSubresource::Freeze => {
            let opts: FreezeUnfreezeTimeout = body_of(req).await?;
            Bytes::from(serde_json::to_vec(&opts).map_err(Refusal::internal)?)
        }
        _ => axum::body::to_bytes(req.into_body(), MAX_BODY)
            .await
            .map_err(|e| Refusal::bad_request(format!("reading the request body: {e}")))?,
    };
    let path = match query {
        Some(q) => format!("{handler_path}?{q}"),
        None => handler_path,
    };
    let answer = app.handlers.call(&node, method, &path, body).await?;
    if !answer.status.is_success() {
        let message = handler_message(&String::from_utf8_lossy(&answer.body));
        return Err(Refusal {
            code: answer.status,
            reason: if answer.status == StatusCode::CONFLICT {
                "Conflict"
            } else {
                "InternalError"
            },
            message,
        });
    }
    let mut resp = Response::new(Body::from(answer.body));
    if let Some(ct) = answer.content_type {
        resp.headers_mut().insert(http::header::CONTENT_TYPE, ct);
    }
    Ok(resp)
}

/// The node a VMI runs on, or 409.
fn node_of(vmi: &VirtualMachineInstance, name: &str) -> Result<String, Refusal> {
    vmi.status
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .filter(|n| !n.is_empty())
        .ok_or_else(|| {
            Refusal::conflict(
                "virtualmachineinstance",
                name,
                "VMI is not scheduled to a node",
            )
        })
}

/// `portforward/{port}[/{protocol}]`'s port and protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forward {
    pub port: u16,
    /// `tcp` or `udp`.
    pub protocol: &'static str,
}

/// Parses what follows `portforward/`: a port from 1 to 65535 and an optional protocol (`tcp`
/// when absent, or `udp`); 400 naming the bad value otherwise.
pub fn parse_port_forward(rest: &[String]) -> Result<Forward, Refusal> {
    let (port, protocol) = match rest {
        [] => return Err(Refusal::bad_request("port must not be empty")),
        [port] => (port, None),
        [port, protocol] => (port, Some(protocol.as_str())),
        more => {
            return Err(Refusal::bad_request(format!(
                "unexpected path after portforward: {:?}: expected {{port}}[/{{protocol}}]",
                more.join("/")
            )));
        }
    };
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| {
            Refusal::bad_request(format!(
                "invalid port {port:?}: expected a number from 1 to 65535"
            ))
        })?;
    let protocol = match protocol {
        None | Some("tcp") => "tcp",
        Some("udp") => "udp",
        Some(other) => {
            return Err(Refusal::bad_request(format!(
                "invalid protocol {other:?}: expected tcp or udp"
            )));
        }
    };
    Ok(Forward { port, protocol })
}

/// Port-forward to a fetched VMI: KubeVirt's checks, then the handler's websocket relayed.
async fn port_forward(
    app: &App,
    req: Request<Body>,
    ns: &str,
    vmi: &VirtualMachineInstance,
    f: Forward,
) -> Result<Response, Refusal> {
    let name = vmi.metadata.name.as_deref().unwrap_or_default();
    precheck(vmi, VmiSubresource::PortForward)?;
    let node = node_of(vmi, name)?;
    let path = format!(
        "/v1/namespaces/{ns}/virtualmachineinstances/{name}/portforward/{}/{}",
        f.port, f.protocol
    );
    stream(app, req, &node, &path).await
}

/// Dials the handler's websocket first, so a refusal there is this request's status rather
/// than a websocket that closes at once; then answers the client's upgrade and splices the two
/// upgraded connections byte for byte. Both hops carry the same websocket framing (frames from
/// the client masked, from the server not, no extension negotiated on either), so the frames
/// need no decoding here: kube-apiserver relays the same bytes the same way.
async fn stream(
    app: &App,
    req: Request<Body>,
    node: &str,
    handler_path: &str,
) -> Result<Response, Refusal> {
    let (mut parts, _) = req.into_parts();
    let key = websocket_key(&parts.headers).map_err(|why| {
        Refusal::bad_request(format!(
            "a websocket upgrade (subprotocol {}) is required: {why}",
            sr::PLAIN_STREAM_PROTOCOL
        ))
    })?;
    let on_upgrade = parts
        .extensions
        .remove::<hyper::upgrade::OnUpgrade>()
        .ok_or_else(|| Refusal::bad_request("the connection cannot be upgraded"))?;
    let upstream = app.handlers.upgrade(node, handler_path).await?;
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(client) => {
                let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
                if let Err(e) = tokio::io::copy_bidirectional_with_sizes(
                    &mut client,
                    &mut upstream,
                    RELAY_BUFFER,
                    RELAY_BUFFER,
                )
                .await
                {
                    tracing::debug!(error = %e, "stream ended");
                }
            }
            Err(e) => tracing::debug!(error = %e, "client upgrade failed"),
        }
    });
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("Upgrade"),
    );
    h.insert(
        http::header::UPGRADE,
        http::HeaderValue::from_static("websocket"),
    );
    h.insert(
        http::header::SEC_WEBSOCKET_ACCEPT,
        derive_accept_key(key.as_bytes())
            .parse()
            .map_err(Refusal::internal)?,
    );
    h.insert(
        http::header::SEC_WEBSOCKET_PROTOCOL,
        http::HeaderValue::from_static(sr::PLAIN_STREAM_PROTOCOL),
    );
    Ok(resp)
}

/// The client's `Sec-WebSocket-Key` of a valid websocket upgrade request (RFC 6455 4.2.1),
/// offering KubeVirt's subprotocol when it offers any.
fn websocket_key(h: &http::HeaderMap) -> Result<String, &'static str> {
    let has = |name: http::header::HeaderName, token: &str| {
        h.get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    if !has(http::header::CONNECTION, "upgrade") {
        return Err("no Connection: upgrade");
    }
    if !has(http::header::UPGRADE, "websocket") {
        return Err("no Upgrade: websocket");
    }
    if h.get(http::header::SEC_WEBSOCKET_VERSION)
        .map(http::HeaderValue::as_bytes)
        != Some(b"13")
    {
        return Err("Sec-WebSocket-Version is not 13");
    }
    if h.contains_key(http::header::SEC_WEBSOCKET_PROTOCOL)
        && !has(
            http::header::SEC_WEBSOCKET_PROTOCOL,
            sr::PLAIN_STREAM_PROTOCOL,
        )
    {
        return Err("the subprotocols offered do not include plain.kubevirt.io");
    }
    h.get(http::header::SEC_WEBSOCKET_KEY)
        .and_then(|k| k.to_str().ok())
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .ok_or("no Sec-WebSocket-Key")
}

async fn vm_subresource(
    app: &App,
    req: Request<Body>,
    ns: &str,
    name: &str,
    sub: VmSubresource,
    rest: &[String],
) -> Result<Response, Refusal> {
    match sub {
        VmSubresource::AddVolume => return hotplug_volume(app, req, ns, name, true, true).await,
        VmSubresource::RemoveVolume => {
            return hotplug_volume(app, req, ns, name, true, false).await;
        }
        _ => {}
    }
    let forward = if sub == VmSubresource::PortForward {
        Some(parse_port_forward(rest)?)
    } else {
        None
    };
    let vms = Api::<api::VirtualMachine>::namespaced(app.client.clone(), ns);
    let vm = vms
        .get_opt(name)
        .await
        .map_err(|e| Refusal::internal(format!("unable to retrieve vm [{name}]: {e}")))?
        .ok_or_else(|| Refusal::not_found("virtualmachine", name))?;
    if let Some(f) = forward {
        // KubeVirt's `FetchVirtualMachineInstanceForVM`: the VM's own VMI, once created.
        if !vm.status.as_ref().and_then(|s| s.created).unwrap_or(false) {
            return Err(Refusal::conflict(
                "virtualmachine",
                name,
                "VMI is not started",
            ));
        }
        let vmi = get_vmi(&app.client, ns, name).await?;
        let owned = vm.metadata.uid.as_ref().is_some_and(|uid| {
            vmi.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|r| &r.uid == uid)
        });
        if !owned {
            return Err(Refusal::internal(format!(
                "unable to retrieve vmi [{name}] for vm: it is not the VM's"
            )));
        }
        return Box::pin(port_forward(app, req, ns, &vmi, f)).await;
    }
    let vmis = Api::<VirtualMachineInstance>::namespaced(app.client.clone(), ns);
    let vmi = vmis
        .get_opt(name)
        .await
        .map_err(|e| Refusal::internal(format!("unable to retrieve vmi [{name}]: {e}")))?;
    let (calls, dry) = match sub {
        VmSubresource::Start => {
            let o: StartOptions = body_of(req).await?;
            (
                lifecycle::start(&vm, vmi.as_ref(), &o)?,
                dry_run(&o.dry_run)?,
            )
        }
        VmSubresource::Stop => {
            let o: StopOptions = body_of(req).await?;
            (
                lifecycle::stop(&vm, vmi.as_ref(), &o)?,
                dry_run(&o.dry_run)?,
            )
        }
        VmSubresource::Restart => {
            let o: RestartOptions = body_of(req).await?;
            (
                lifecycle::restart(&vm, vmi.as_ref(), &o)?,
                dry_run(&o.dry_run)?,
            )
        }
        VmSubresource::Migrate => {
            let o: MigrateOptions = body_of(req).await?;
            return migrate(app, ns, name, vmi.as_ref(), &o).await;
        }
        // Served before the VM's VMI is read.
        VmSubresource::AddVolume | VmSubresource::RemoveVolume | VmSubresource::PortForward => {
            return Err(Refusal::internal(format!(
                "{} reached the VM's lifecycle requests",
                sub.as_str()
            )));
        }
    };
    let pp = PatchParams {
        dry_run: dry,
        ..Default::default()
    };
    let json_patch = |p| {
        serde_json::from_value(p)
            .map(Patch::<()>::Json)
            .map_err(Refusal::internal)
    };
    for call in calls {
        let result = match call {
            Call::PatchVmi(p) => vmis.patch(name, &pp, &json_patch(p)?).await.map(drop),
            Call::PatchVm(p) => vms.patch(name, &pp, &json_patch(p)?).await.map(drop),
            Call::PatchVmStatus(p) => vms.patch_status(name, &pp, &json_patch(p)?).await.map(drop),
        };
        result.map_err(|e| match e {
            // A failed `test` op: the VM changed since it was read.
            kube::Error::Api(s) if s.code == 422 || s.code == 409 => {
                Refusal::conflict("virtualmachine", name, s.message)
            }
            other => Refusal::internal(other),
        })?;
    }
    Ok(StatusCode::ACCEPTED.into_response())
}

/// The object `name` of kind `K` as the API server stores it, or 404. `short` is KubeVirt's
/// name for it in messages (`vm`, `vmi`).
async fn get_raw<K: kube::Resource<DynamicType = ()>>(
    client: &Client,
    ns: &str,
    name: &str,
    short: &str,
) -> Result<(Api<DynamicObject>, Value), Refusal> {
    let api = Api::namespaced_with(client.clone(), ns, &ApiResource::erase::<K>(&()));
    let object = api
        .get_opt(name)
        .await
        .map_err(|e| Refusal::internal(format!("unable to retrieve {short} [{name}]: {e}")))?
        .ok_or_else(|| Refusal::not_found(&K::kind(&()).to_lowercase(), name))?;
    let raw = serde_json::to_value(object).map_err(Refusal::internal)?;
    Ok((api, raw))
}

/// `addvolume` (`add`) or `removevolume` of the VM (`on_vm`) or VMI `name`, in KubeVirt's
/// order: the gates, the body, the object, its checks, then the patch (202).
async fn hotplug_volume(
    app: &App,
    req: Request<Body>,
    ns: &str,
    name: &str,
    on_vm: bool,
    add: bool,
) -> Result<Response, Refusal> {
    let gates = app.hotplug_gates();
    if !gates.enabled() {
        return Err(Refusal::bad_request(volumes::HOTPLUG_NOT_ENABLED));
    }
    let request = if add {
        VolumeRequest::add(body_of::<AddVolumeOptions>(req).await?)?
    } else {
        VolumeRequest::remove(body_of::<RemoveVolumeOptions>(req).await?)?
    };
    let dry = dry_run(request.dry_run())?;
    let (resource, short) = if on_vm {
        ("virtualmachine", "vm")
    } else {
        ("virtualmachineinstance", "vmi")
    };
    let (api, patch) = if on_vm {
        let (api, raw) = get_raw::<VirtualMachine>(&app.client, ns, name, short).await?;
        let vm: VirtualMachine = serde_json::from_value(raw.clone()).map_err(Refusal::internal)?;
        let existing = vm.spec.template.spec.map(|s| s.volumes).unwrap_or_default();
        volumes::verify(&existing, &request)
            .map_err(|why| Refusal::conflict(resource, name, why))?;
        let spec = raw.pointer("/spec/template/spec").unwrap_or(&Value::Null);
        (api, volumes::patch("/spec/template", spec, &request))
    } else {
        let (api, raw) = get_raw::<VirtualMachineInstance>(&app.client, ns, name, short).await?;
        let vmi: VirtualMachineInstance =
            serde_json::from_value(raw.clone()).map_err(Refusal::internal)?;
        // Without the deprecated gate, a VM's VMI follows the VM's template only.
        if volumes::owned_by_vm(&vmi) && !gates.legacy {
            return Err(Refusal::bad_request(format!(
                "VMI {ns}/{name} is owned by a VM"
            )));
        }
        if !running(&vmi) {
            return Err(Refusal::conflict(resource, name, volumes::VMI_NOT_RUNNING));
        }
        volumes::verify(&vmi.spec.volumes, &request)
            .map_err(|why| Refusal::conflict(resource, name, why))?;
        let spec = raw.get("spec").unwrap_or(&Value::Null);
        (api, volumes::patch("", spec, &request))
    };
    let patch: json_patch::Patch = patch
        .and_then(serde_json::from_value)
        .map_err(|e| Refusal::conflict(resource, name, e))?;
    let pp = PatchParams {
        dry_run: dry,
        ..Default::default()
    };
    // Encoded as Go encodes, or a `test` of a string holding `&` (a cloud-init script) fails.
    informer::patch::json_patch(&api, name, &pp, patch)
        .await
        .map_err(|e| match e {
            // A failed `test` (the object changed since it was read) or a webhook's refusal:
            // passed on as it is, as KubeVirt does, so virtctl can tell and retry the first.
            kube::Error::Api(s) if s.code == 422 => Refusal::from_kube(kube::Error::Api(s)),
            other => Refusal::internal(format!("unable to patch {short}: {other}")),
        })?;
    Ok(StatusCode::ACCEPTED.into_response())
}

async fn migrate(
    app: &App,
    ns: &str,
    name: &str,
    vmi: Option<&VirtualMachineInstance>,
    o: &MigrateOptions,
) -> Result<Response, Refusal> {
    let vmi = vmi.ok_or_else(|| Refusal::not_found("virtualmachineinstance", name))?;
    if !running(vmi) {
        return Err(Refusal::conflict(
            "virtualmachine",
            name,
            lifecycle::VM_NOT_RUNNING,
        ));
    }
    let migration: api::migration::VirtualMachineInstanceMigration =
        serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstanceMigration",
            "metadata": {"generateName": "kubevirt-migrate-vm-"},
            "spec": {"vmiName": name, "addedNodeSelector": o.added_node_selector},
        }))
        .map_err(Refusal::internal)?;
    let pp = PostParams {
        dry_run: dry_run(&o.dry_run)?,
        ..Default::default()
    };
    Api::namespaced(app.client.clone(), ns)
        .create(&pp, &migration)
        .await
        .map_err(Refusal::internal)?;
    Ok(StatusCode::ACCEPTED.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rest(parts: &[&str]) -> Vec<String> {
        parts.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn port_forward_rest_is_a_port_and_an_optional_protocol() {
        let ok = |port, protocol| Ok(Forward { port, protocol });
        let cases: [(&[&str], Result<Forward, &str>); 12] = [
            (&["22"], ok(22, "tcp")),
            (&["22", "tcp"], ok(22, "tcp")),
            (&["53", "udp"], ok(53, "udp")),
            (&["1"], ok(1, "tcp")),
            (&["65535", "tcp"], ok(65535, "tcp")),
            (&[], Err("port must not be empty")),
            (&["0"], Err("\"0\"")),
            (&["65536"], Err("\"65536\"")),
            (&["ssh", "tcp"], Err("\"ssh\"")),
            (&["-1"], Err("\"-1\"")),
            (&["22", "sctp"], Err("\"sctp\"")),
            (&["22", "tcp", "x"], Err("\"22/tcp/x\"")),
        ];
        for (parts, want) in cases {
            let got = parse_port_forward(&rest(parts));
            match (got, want) {
                (Ok(g), Ok(w)) => assert_eq!(g, w, "{parts:?}"),
                (Err(e), Err(needle)) => {
                    assert_eq!(e.code, StatusCode::BAD_REQUEST, "{parts:?}");
                    assert!(e.message.contains(needle), "{parts:?}: {}", e.message);
                }
                (got, want) => panic!("{parts:?}: got {got:?}, want {want:?}"),
            }
        }
    }
}
