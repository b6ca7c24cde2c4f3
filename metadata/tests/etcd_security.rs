//! The etcd store against real etcd servers that demand more than plain HTTP/2: one that
//! serves TLS and wants client certificates (a CA and certificates made here with rcgen), and
//! one with authentication enabled (`etcdctl user add`, `etcdctl auth enable`).

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tern_metadata::etcd::{EtcdConfig, EtcdStore};
use tern_metadata::keys;
use tern_metadata::{
    EtcdCredentials, EtcdTls, MetadataError, MetadataStore, RpcMeta, StoreOptions, open_store,
};
use tern_testkit::etcd::{Etcd, LaunchOptions, TlsFiles, etcdctl_with, unique};

const GOLDEN_TCP: &str = include_str!("golden/mooncake-tcp-segment.json");

fn config(endpoint: &str) -> EtcdConfig {
    let mut config = EtcdConfig::from_env(vec![endpoint.to_owned()]).unwrap();
    config.tls = None;
    config.credentials = None;
    config.timeout = Duration::from_secs(3);
    config
}

/// A CA, and a server and a client certificate it signed, as PEM files in `dir`.
struct Pki {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn make_ca(name: &str) -> (CertificateParams, KeyPair, String) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().unwrap();
    let pem = params.self_signed(&key).unwrap().pem();
    (params, key, pem)
}

fn pki(dir: &Path) -> Pki {
    std::fs::create_dir_all(dir).unwrap();
    let (ca_params, ca_key, ca_pem) = make_ca("tern test CA");
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |cn: &str, sans: Vec<String>, usage: ExtendedKeyUsagePurpose| {
        let mut params = CertificateParams::new(sans).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(
        "etcd",
        vec!["127.0.0.1".into(), "localhost".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert, client_key) =
        leaf("tern-node", Vec::new(), ExtendedKeyUsagePurpose::ClientAuth);
    Pki {
        ca: write(dir, "ca.pem", &ca_pem),
        server_cert: write(dir, "server.pem", &server_cert),
        server_key: write(dir, "server-key.pem", &server_key),
        client_cert: write(dir, "client.pem", &client_cert),
        client_key: write(dir, "client-key.pem", &client_key),
    }
}

fn launch(options: LaunchOptions) -> Etcd {
    let dir = std::env::temp_dir().join(unique("tern-etcd-sec"));
    Etcd::launch_with(IpAddr::V4(Ipv4Addr::LOCALHOST), None, dir, None, options)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn meta(port: u16) -> RpcMeta {
    RpcMeta {
        ip_or_host_name: "127.0.0.1".into(),
        rpc_port: port,
    }
}

/// Publishes a descriptor and an RPC location through `store` and reads both back.
fn round_trip(store: &dyn MetadataStore, name: &str) {
    let desc = tern_metadata::SegmentDesc::from_json(GOLDEN_TCP.as_bytes()).unwrap();
    store.publish_segment(name, &desc).unwrap();
    assert_eq!(store.fetch_segment(name).unwrap(), desc);
    store.publish_rpc_meta(name, &meta(15001)).unwrap();
    assert_eq!(store.rpc_meta(name).unwrap(), meta(15001));
}

#[test]
fn tls_with_client_certificates_reaches_etcd_and_nothing_less_does() {
    let dir = std::env::temp_dir().join(unique("tern-pki"));
    let pki = pki(&dir);
    let etcd = launch(LaunchOptions {
        tls: Some(TlsFiles {
            cert: pki.server_cert.clone(),
            key: pki.server_key.clone(),
            client_ca: Some(pki.ca.clone()),
        }),
        ..LaunchOptions::default()
    });
    let tls = EtcdTls {
        ca: Some(pki.ca.clone()),
        cert: Some(pki.client_cert.clone()),
        key: Some(pki.client_key.clone()),
        domain: None,
    };

    // Through `open_store`, as the engine opens it: options reach etcd-client.
    let name = unique("tls-node");
    let store = open_store(
        &format!("etcd://{}", etcd.endpoint),
        StoreOptions {
            etcd_tls: Some(tls.clone()),
            ..StoreOptions::default()
        },
    )
    .unwrap();
    round_trip(&*store, &name);
    // etcdctl, with the same certificates, sees the key Mooncake's layout puts it under.
    let certs = [
        format!("--cacert={}", pki.ca.display()),
        format!("--cert={}", pki.client_cert.display()),
        format!("--key={}", pki.client_key.display()),
    ];
    let certs: Vec<&str> = certs.iter().map(String::as_str).collect();
    let value = etcdctl_with(
        &etcd.endpoint,
        &certs,
        &["get", &keys::segment_key(None, &name), "--print-value-only"],
    );
    assert!(value.contains("\"protocol\""), "{value}");

    // Without a client certificate, without TLS, or trusting another CA: no connection.
    let mut no_client_cert = config(&etcd.endpoint);
    no_client_cert.tls = Some(EtcdTls {
        cert: None,
        key: None,
        ..tls.clone()
    });
    assert!(matches!(
        EtcdStore::connect(no_client_cert),
        Err(MetadataError::Store { .. })
    ));
    assert!(matches!(
        EtcdStore::connect(config(&etcd.endpoint)),
        Err(MetadataError::Store { .. })
    ));
    let (_, _, other_ca) = make_ca("another CA");
    let mut wrong_ca = config(&etcd.endpoint);
    wrong_ca.tls = Some(EtcdTls {
        ca: Some(write(&dir, "other-ca.pem", &other_ca)),
        ..tls.clone()
    });
    assert!(matches!(
        EtcdStore::connect(wrong_ca),
        Err(MetadataError::Store { .. })
    ));

    // Incomplete settings are named before any connection is tried.
    let mut half = config(&etcd.endpoint);
    half.tls = Some(EtcdTls {
        key: None,
        ..tls.clone()
    });
    match EtcdStore::connect(half) {
        Err(MetadataError::EtcdSettings(message)) => {
            assert!(message.contains("TERN_ETCD_KEY"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    let mut no_ca = config(&etcd.endpoint);
    no_ca.tls = Some(EtcdTls { ca: None, ..tls });
    assert!(matches!(
        EtcdStore::connect(no_ca),
        Err(MetadataError::EtcdSettings(_))
    ));
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_login_reaches_an_etcd_with_auth_enabled_and_survives_token_expiry() {
    // Tokens that expire after a second, so the test sees one refused and refreshed.
    let etcd = launch(LaunchOptions {
        extra_args: vec!["--auth-token-ttl=1".into()],
        ..LaunchOptions::default()
    });
    etcdctl_with(&etcd.endpoint, &[], &["user", "add", "root:r00t-pw"]);
    etcdctl_with(&etcd.endpoint, &[], &["auth", "enable"]);
    let root = ["--user=root:r00t-pw"];

    let login = EtcdCredentials {
        user: "root".into(),
        password: "r00t-pw".into(),
    };
    assert!(
        !format!("{login:?}").contains("r00t-pw"),
        "password printed"
    );
    let name = unique("auth-node");
    let store = open_store(
        &format!("etcd://{}", etcd.endpoint),
        StoreOptions {
            etcd_credentials: Some(login.clone()),
            ..StoreOptions::default()
        },
    )
    .unwrap();
    round_trip(&*store, &name);
    let key = keys::rpc_meta_key(None, &name);
    let value = etcdctl_with(&etcd.endpoint, &root, &["get", &key, "--print-value-only"]);
    assert!(value.contains("15001"), "{value}");

    // Past the token's TTL the store still writes and reads: it logged in again.
    std::thread::sleep(Duration::from_secs(3));
    store.publish_rpc_meta(&name, &meta(15002)).unwrap();
    assert_eq!(store.rpc_meta(&name).unwrap(), meta(15002));
    let value = etcdctl_with(&etcd.endpoint, &root, &["get", &key, "--print-value-only"]);
    assert!(value.contains("15002"), "{value}");

    // Without a login, or with a wrong password, etcd is not reachable for the store.
    assert!(matches!(
        EtcdStore::connect(config(&etcd.endpoint)),
        Err(MetadataError::Store { .. })
    ));
    let mut wrong = config(&etcd.endpoint);
    wrong.credentials = Some(EtcdCredentials {
        password: "guess".into(),
        ..login
    });
    assert!(matches!(
        EtcdStore::connect(wrong),
        Err(MetadataError::Store { .. })
    ));

    // A clean shutdown still deletes this node's keys under authentication.
    drop(store);
    let left = etcdctl_with(&etcd.endpoint, &root, &["get", &key, "--print-value-only"]);
    assert!(left.trim().is_empty(), "{left}");
}

/// The environment variables reach the store: run in a child process of this test binary,
/// since a test must not change its own process's environment.
#[test]
fn the_login_and_tls_come_from_the_environment_too() {
    if let Ok(endpoint) = std::env::var("TERN_TEST_ENV_ETCD") {
        // The child: every setting comes from the environment.
        let store = open_store(&format!("etcd://{endpoint}"), StoreOptions::default()).unwrap();
        round_trip(&*store, &unique("env-node"));
        return;
    }
    let etcd = launch(LaunchOptions::default());
    etcdctl_with(&etcd.endpoint, &[], &["user", "add", "root:env-pw"]);
    etcdctl_with(&etcd.endpoint, &[], &["auth", "enable"]);
    let child = |vars: &[(&str, &str)]| {
        let mut command = std::process::Command::new(std::env::current_exe().unwrap());
        command
            .args([
                "--exact",
                "the_login_and_tls_come_from_the_environment_too",
                "--nocapture",
            ])
            .env("TERN_TEST_ENV_ETCD", &etcd.endpoint);
        for var in [
            "TERN_ETCD_USER",
            "TERN_ETCD_PASSWORD",
            "TERN_ETCD_CA",
            "TERN_ETCD_CERT",
            "TERN_ETCD_KEY",
        ] {
            command.env_remove(var);
        }
        command.envs(vars.iter().copied());
        let output = command.output().unwrap();
        let text =
            String::from_utf8_lossy(&output.stdout) + String::from_utf8_lossy(&output.stderr);
        // A filter that matched no test would pass too: insist the child ran this one.
        let ran = text.contains("1 passed") || text.contains("1 failed");
        assert!(ran, "the child ran no test: {text}");
        (output.status.success(), text.into_owned())
    };
    let (ok, out) = child(&[("TERN_ETCD_USER", "root"), ("TERN_ETCD_PASSWORD", "env-pw")]);
    assert!(ok, "with the login: {out}");
    let (ok, _) = child(&[]);
    assert!(!ok, "etcd with auth enabled served a store without a login");
    let (ok, out) = child(&[("TERN_ETCD_USER", "root")]);
    assert!(!ok && out.contains("TERN_ETCD_PASSWORD"), "{out}");
    let (ok, out) = child(&[("TERN_ETCD_CERT", "/nonexistent/cert.pem")]);
    assert!(!ok && out.contains("TERN_ETCD_CA"), "{out}");
}

const SECRET: &str = "tern-etcd-replay-secret";

/// A node's store on `endpoint` with the cluster secret: one life of the node.
fn sealed(endpoint: &str) -> Box<dyn MetadataStore> {
    let secret = tern_metadata::auth::ClusterSecret::new(SECRET.as_bytes()).unwrap();
    let mut options = StoreOptions::default();
    options.rpc_client.secret = Some(secret);
    open_store(&format!("etcd://{endpoint}"), options).unwrap()
}

#[test]
fn a_node_holding_a_restarted_peers_descriptor_ignores_its_old_one_put_back_into_etcd() {
    use parking_lot::Mutex;
    use std::sync::Arc;
    use tern_metadata::MetadataEvent;
    let (endpoint, _etcd) = tern_testkit::etcd::shared();
    let name = unique("replayed-node");
    let key = keys::segment_key(None, &name);
    let old = tern_metadata::SegmentDesc::from_json(GOLDEN_TCP.as_bytes()).unwrap();
    let mut new = old.clone();
    new.tcp_data_port = new.tcp_data_port.wrapping_add(1000);
    new.buffers[0].addr += 1 << 30;

    // A peer that watches, and keeps every change it takes for this segment.
    let watcher = sealed(&endpoint);
    let taken: Arc<Mutex<Vec<Option<tern_metadata::SegmentDesc>>>> = Arc::default();
    let markers: Arc<Mutex<Vec<RpcMeta>>> = Arc::default();
    let (record, mark, watched) = (taken.clone(), markers.clone(), name.clone());
    watcher.subscribe(Arc::new(move |event| match event {
        MetadataEvent::Segment { name, desc } if name == watched => record.lock().push(desc),
        MetadataEvent::RpcMeta {
            server,
            meta: Some(meta),
        } if server == watched => mark.lock().push(meta),
        _ => {}
    }));
    let seen = |desc: &Option<tern_metadata::SegmentDesc>| {
        tern_testkit::etcd::eventually(Duration::from_secs(20), || {
            taken.lock().last() == Some(desc)
        })
        .is_some()
    };

    // The node's first life publishes; an attacker reads etcd and saves the sealed value.
    let first = sealed(&endpoint);
    first.publish_segment(&name, &old).unwrap();
    assert!(
        seen(&Some(old.clone())),
        "the watcher never saw the first life"
    );
    assert_eq!(watcher.fetch_segment(&name).unwrap(), old);
    let saved = tern_testkit::etcd::get(&endpoint, &key).unwrap();
    assert!(saved.contains("tern_mac"), "{saved}");
    // It stops (its keys are deleted), and comes back: a new store, the same name and
    // secret, new ports and buffers.
    drop(first);
    assert!(seen(&None), "the watcher never saw the first life end");
    let second = sealed(&endpoint);
    second.publish_segment(&name, &new).unwrap();
    assert!(
        seen(&Some(new.clone())),
        "the watcher never saw the second life"
    );

    // The attacker puts the saved descriptor back, straight into etcd, byte for byte
    // (`etcdctl get` printed it with one newline more than it holds).
    let replay = saved.strip_suffix('\n').unwrap_or(&saved);
    tern_testkit::etcd::etcdctl(&endpoint, &["put", &key, replay]);
    // A marker the node writes after it: once the watcher has it, it has had the replay too
    // (etcd delivers a watch in revision order).
    let marker = meta(15777);
    second.publish_rpc_meta(&name, &marker).unwrap();
    let marked = tern_testkit::etcd::eventually(Duration::from_secs(20), || {
        markers.lock().contains(&marker)
    });
    assert!(marked.is_some(), "the watcher never saw the marker");
    let changes = taken.lock().clone();
    assert_eq!(
        changes.last(),
        Some(&Some(new.clone())),
        "the watcher took the replayed descriptor: {changes:?}"
    );
    // Reading the key again does not bring the old descriptor back either.
    match watcher.fetch_segment(&name) {
        Ok(desc) => assert_eq!(desc, new, "the replayed descriptor was taken"),
        Err(MetadataError::Seal {
            key: refused,
            source: tern_metadata::seal::SealError::Stale { .. },
        }) => assert_eq!(refused, key),
        Err(other) => panic!("{other}"),
    }
    // The node saw its key overwritten and put its own value back, so a node that starts
    // now (and has no newer value to compare with) does not take the replay either.
    let restored = tern_testkit::etcd::eventually(Duration::from_secs(20), || {
        tern_testkit::etcd::get(&endpoint, &key).is_some_and(|v| v != saved)
    });
    assert!(restored.is_some(), "etcd kept the replayed descriptor");
    assert_eq!(sealed(&endpoint).fetch_segment(&name).unwrap(), new);
    assert_eq!(watcher.fetch_segment(&name).unwrap(), new);
    drop(second);
    drop(watcher);
}
