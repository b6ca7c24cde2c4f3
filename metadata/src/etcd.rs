//! The etcd store: Mooncake's key layout, plus what Mooncake lacks — every key this node
//! writes lives under a lease that is kept alive, so a dead node's keys vanish within the TTL;
//! a lost lease or an etcd restart is healed by re-granting and re-publishing; and a watch on
//! the prefix tells caches about every change. With a cluster secret, a node that sees one of
//! its keys overwritten with anything but a newer value of its own name puts its value back.
//!
//! The tokio runtime etcd-client needs lives inside this store; callers see blocking calls.
//!
//! Security, from the environment or [`StoreOptions`](crate::StoreOptions): TLS when a CA is
//! given (`TERN_ETCD_CA`, with `TERN_ETCD_CERT` and `TERN_ETCD_KEY` for an etcd that demands
//! client certificates, `TERN_ETCD_DOMAIN` when its certificate names another host than the
//! endpoint), and a login (`TERN_ETCD_USER`, `TERN_ETCD_PASSWORD`) for an etcd with
//! authentication enabled; its token is refreshed when etcd expires it. Endpoints stay
//! `host:port` (or `etcd://host:port`): TLS follows from the CA, not from the scheme.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use etcd_client::{
    Certificate, Client, ConnectOptions, EventType, GetOptions, Identity, PutOptions, TlsOptions,
    WatchOptions,
};
use parking_lot::Mutex;
use tokio::runtime::Runtime;
use tokio::sync::Notify;

use crate::error::MetadataError;
use crate::keyed::{Codec, KeyValue, KeyedStore};
use crate::keys;
use crate::store::{EtcdCredentials, EtcdTls, MetadataEvent, MetadataListener};

/// Environment variable with the lease TTL in seconds.
pub const TTL_ENV: &str = "TERN_ETCD_TTL_SECS";
/// Environment variable: how many seconds to keep retrying an unreachable etcd at start
/// (0, the default, fails at once).
pub const START_RETRY_ENV: &str = "TERN_ETCD_START_RETRY_SECS";
/// Environment variable: PEM file of the CA that signed etcd's certificate; turns TLS on.
pub const CA_ENV: &str = "TERN_ETCD_CA";
/// Environment variable: PEM file of this node's client certificate.
pub const CERT_ENV: &str = "TERN_ETCD_CERT";
/// Environment variable: PEM file of the client certificate's key.
pub const KEY_ENV: &str = "TERN_ETCD_KEY";
/// Environment variable: the name etcd's certificate must carry, when not the endpoint's host.
pub const DOMAIN_ENV: &str = "TERN_ETCD_DOMAIN";
/// Environment variable: the etcd user to log in as.
pub const USER_ENV: &str = "TERN_ETCD_USER";
/// Environment variable: that user's password.
pub const PASSWORD_ENV: &str = "TERN_ETCD_PASSWORD";

/// Settings of the etcd store.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// `host:port` of each etcd member.
    pub endpoints: Vec<String>,
    /// `MC_METADATA_CLUSTER_ID`: scopes every key.
    pub cluster_id: Option<String>,
    /// Lease TTL: how long a dead node's keys survive it.
    pub ttl: Duration,
    /// Bound on connecting and on each operation.
    pub timeout: Duration,
    /// How long to keep retrying (with backoff) when etcd is unreachable at start.
    pub start_retry: Duration,
    /// TLS settings; `None` speaks plain HTTP/2.
    pub tls: Option<EtcdTls>,
    /// The user to log in as; `None` for an etcd without authentication.
    pub credentials: Option<EtcdCredentials>,
}

/// A non-empty environment variable.
fn env_value(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl EtcdConfig {
    /// Defaults (TTL 10 s, 5 s timeouts, no start retry, no TLS, no login), overridden by
    /// `MC_METADATA_CLUSTER_ID`, `TERN_ETCD_TTL_SECS`, `TERN_ETCD_START_RETRY_SECS`, the TLS
    /// variables (`TERN_ETCD_CA`, `TERN_ETCD_CERT`, `TERN_ETCD_KEY`, `TERN_ETCD_DOMAIN`) and
    /// the login (`TERN_ETCD_USER`, `TERN_ETCD_PASSWORD`). A user without a password is an
    /// error, so that a forgotten variable is not taken for an empty password.
    pub fn from_env(endpoints: Vec<String>) -> Result<Self, MetadataError> {
        let secs = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(Duration::from_secs_f64)
        };
        Ok(Self {
            endpoints,
            cluster_id: std::env::var(keys::CLUSTER_ID_ENV)
                .ok()
                .filter(|c| !c.is_empty()),
            ttl: secs(TTL_ENV)
                .filter(|t| *t >= Duration::from_secs(1))
                .unwrap_or(Duration::from_secs(10)),
            timeout: Duration::from_secs(5),
            start_retry: secs(START_RETRY_ENV).unwrap_or(Duration::ZERO),
            tls: tls_from_env(),
            credentials: credentials_from_env()?,
        })
    }
}

fn tls_from_env() -> Option<EtcdTls> {
    let tls = EtcdTls {
        ca: env_value(CA_ENV).map(Into::into),
        cert: env_value(CERT_ENV).map(Into::into),
        key: env_value(KEY_ENV).map(Into::into),
        domain: env_value(DOMAIN_ENV),
    };
    (tls != EtcdTls::default()).then_some(tls)
}

fn credentials_from_env() -> Result<Option<EtcdCredentials>, MetadataError> {
    match (env_value(USER_ENV), std::env::var(PASSWORD_ENV).ok()) {
        (Some(user), Some(password)) => Ok(Some(EtcdCredentials { user, password })),
        (Some(_), None) => Err(MetadataError::EtcdSettings(format!(
            "{USER_ENV} is set but {PASSWORD_ENV} is not"
        ))),
        (None, Some(_)) => Err(MetadataError::EtcdSettings(format!(
            "{PASSWORD_ENV} is set but {USER_ENV} is not"
        ))),
        (None, None) => Ok(None),
    }
}

/// etcd-client's TLS options from file paths: the files are read here, so a missing or
/// unreadable one is named before any connection is tried.
fn tls_options(tls: &EtcdTls) -> Result<TlsOptions, MetadataError> {
    let read = |what: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| {
            MetadataError::EtcdSettings(format!("reading the etcd {what} {path:?}: {e}"))
        })
    };
    let ca = tls.ca.as_deref().ok_or_else(|| {
        MetadataError::EtcdSettings(format!(
            "TLS to etcd needs the CA that signed etcd's certificate ({CA_ENV})"
        ))
    })?;
    let mut options = TlsOptions::new().ca_certificate(Certificate::from_pem(read("CA", ca)?));
    match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => {
            options = options.identity(Identity::from_pem(
                read("client certificate", cert)?,
                read("client key", key)?,
            ));
        }
        (None, None) => {}
        _ => {
            return Err(MetadataError::EtcdSettings(format!(
                "a client certificate needs both {CERT_ENV} and {KEY_ENV}"
            )));
        }
    }
    if let Some(domain) = &tls.domain {
        options = options.domain_name(domain.clone());
    }
    Ok(options)
}

struct Shared {
    client: Client,
    config: EtcdConfig,
    codec: Arc<Codec>,
    endpoint: String,
    lease: AtomicI64,
    /// Every key this node wants to exist, with its value: re-put after a lost lease or an
    /// outage.
    published: Mutex<BTreeMap<String, String>>,
    /// Some put failed (etcd unreachable): re-publish everything once it answers again.
    dirty: AtomicBool,
    listeners: Mutex<Vec<MetadataListener>>,
    stop: Notify,
    stopped: AtomicBool,
}

/// The etcd metadata store. Dropping it (or [`MetadataStore::shutdown`](crate::MetadataStore::shutdown))
/// deletes this node's keys and revokes its lease.
pub type EtcdStore = KeyedStore<EtcdKv>;

/// The key-value half of [`EtcdStore`]: leased puts, gets, deletes and the watch.
pub struct EtcdKv {
    runtime: Option<Runtime>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for EtcdKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdKv")
            .field("endpoint", &self.shared.endpoint)
            .finish_non_exhaustive()
    }
}

impl EtcdStore {
    /// Connects, grants the lease and starts the keep-alive and watch tasks. Fails with an
    /// error naming the endpoints when etcd cannot be reached (after retrying for
    /// `config.start_retry`).
    pub fn connect(config: EtcdConfig) -> Result<Self, MetadataError> {
        Self::connect_sealed(config, None)
    }

    /// As [`connect`](Self::connect); with `secret`, every value written is sealed (ordered in
    /// this store's own incarnation) and every value read (watched changes included) must
    /// verify and be no older than the newest read before of its key ([`crate::seal`]).
    pub fn connect_sealed(
        config: EtcdConfig,
        secret: Option<crate::auth::ClusterSecret>,
    ) -> Result<Self, MetadataError> {
        let codec = Arc::new(Codec {
            cluster_id: config.cluster_id.clone(),
            sealer: secret.map(|secret| Arc::new(crate::seal::Sealer::new(secret))),
        });
        let kv = EtcdKv::connect(config, codec.clone())?;
        Ok(Self { kv, codec })
    }

    /// The lease this node's keys live under.
    pub fn lease_id(&self) -> i64 {
        self.kv.shared.lease.load(Ordering::Acquire)
    }
}

impl EtcdKv {
    fn connect(config: EtcdConfig, codec: Arc<Codec>) -> Result<Self, MetadataError> {
        let endpoint = config.endpoints.join(",");
        let tls = config.tls.as_ref().map(tls_options).transpose()?;
        let store_error = |message: String| MetadataError::Store {
            endpoint: endpoint.clone(),
            message,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tern-etcd")
            .enable_all()
            .build()
            .map_err(|e| store_error(format!("cannot start the etcd runtime: {e}")))?;
        let (client, lease) = runtime.block_on(async {
            let started = tokio::time::Instant::now();
            let mut backoff = Duration::from_millis(100);
            loop {
                match connect_and_grant(&config, tls.clone()).await {
                    Ok(done) => return Ok(done),
                    Err(e) if started.elapsed() + backoff <= config.start_retry => {
                        tracing::warn!("etcd {endpoint} not reachable yet ({e}); retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                    Err(e) => return Err(store_error(format!("unreachable: {e}"))),
                }
            }
        })?;
        let shared = Arc::new(Shared {
            client,
            config,
            codec,
            endpoint: endpoint.clone(),
            lease: AtomicI64::new(lease),
            published: Mutex::new(BTreeMap::new()),
            dirty: AtomicBool::new(false),
            listeners: Mutex::new(Vec::new()),
            stop: Notify::new(),
            stopped: AtomicBool::new(false),
        });
        runtime.spawn(keep_alive_loop(shared.clone()));
        runtime.spawn(watch_loop(shared.clone()));
        Ok(Self {
            runtime: Some(runtime),
            shared,
        })
    }

    fn block_on<F: std::future::Future>(&self, future: F) -> Option<F::Output> {
        self.runtime.as_ref().map(|r| r.block_on(future))
    }

    fn store_error(&self, message: impl std::fmt::Display) -> MetadataError {
        MetadataError::Store {
            endpoint: self.shared.endpoint.clone(),
            message: message.to_string(),
        }
    }

    fn lease_id(&self) -> i64 {
        self.shared.lease.load(Ordering::Acquire)
    }

    fn publish(&self, key: String, value: String) {
        self.shared
            .published
            .lock()
            .insert(key.clone(), value.clone());
        let shared = self.shared.clone();
        let outcome = self.block_on(async move { put_leased(&shared, &key, &value).await });
        if let Some(Err(e)) = outcome {
            self.shared.dirty.store(true, Ordering::Release);
            tracing::warn!(
                "etcd {}: publishing failed ({e}); it is retried until etcd answers",
                self.shared.endpoint
            );
        }
    }

    fn withdraw(&self, key: &str) -> Result<(), MetadataError> {
        self.shared.published.lock().remove(key);
        let mut client = self.shared.client.clone();
        let timeout = self.shared.config.timeout;
        let key = key.to_owned();
        match self
            .block_on(async move { tokio::time::timeout(timeout, client.delete(key, None)).await })
        {
            Some(Ok(Ok(_))) | None => Ok(()),
            Some(Ok(Err(e))) => Err(self.store_error(e)),
            Some(Err(_)) => Err(self.store_error("delete timed out")),
        }
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetadataError> {
        let mut client = self.shared.client.clone();
        let timeout = self.shared.config.timeout;
        let owned = key.to_owned();
        let reply = self
            .block_on(async move { tokio::time::timeout(timeout, client.get(owned, None)).await })
            .ok_or_else(|| self.store_error("store is shut down"))?
            .map_err(|_| self.store_error(format!("get {key:?} timed out")))?
            .map_err(|e| self.store_error(e))?;
        Ok(reply.kvs().first().map(|kv| kv.value().to_vec()))
    }
}

async fn connect_and_grant(
    config: &EtcdConfig,
    tls: Option<TlsOptions>,
) -> Result<(Client, i64), etcd_client::Error> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(config.timeout)
        .with_timeout(config.timeout);
    if let Some(tls) = tls {
        options = options.with_tls(tls);
    }
    if let Some(login) = &config.credentials {
        // etcd's tokens expire (5 min by default): log in again when one is refused.
        options = options
            .with_user(login.user.clone(), login.password.clone())
            .with_auto_token_refresh(true);
    }
    let mut client = Client::connect(config.endpoints.clone(), Some(options)).await?;
    // A read of the prefix up front: an etcd with authentication enabled grants leases to
    // anyone (3.4), so a missing login or permission would otherwise only show later, as
    // publications that never land.
    let prefix = keys::common_prefix(config.cluster_id.as_deref());
    let probe = GetOptions::new()
        .with_prefix()
        .with_keys_only()
        .with_limit(1);
    client.get(prefix, Some(probe)).await?;
    let lease = client
        .lease_grant(config.ttl.as_secs().max(1) as i64, None)
        .await?
        .id();
    Ok((client, lease))
}

async fn put_leased(shared: &Shared, key: &str, value: &str) -> Result<(), String> {
    let mut client = shared.client.clone();
    let lease = shared.lease.load(Ordering::Acquire);
    let put = client.put(key, value, Some(PutOptions::new().with_lease(lease)));
    match tokio::time::timeout(shared.config.timeout, put).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("put timed out".into()),
    }
}

/// Re-puts every published key under the current lease.
async fn republish(shared: &Shared) -> Result<(), String> {
    let entries: Vec<(String, String)> = shared
        .published
        .lock()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (key, value) in entries {
        put_leased(shared, &key, &value).await?;
    }
    Ok(())
}

/// Keeps the lease alive at a third of its TTL. A lease that etcd no longer knows (expired
/// during an outage, or revoked) is replaced and everything re-published; an outage is
/// waited out with backoff.
async fn keep_alive_loop(shared: Arc<Shared>) {
    let period = shared.config.ttl / 3;
    let mut backoff = Duration::from_millis(100);
    loop {
        let alive = keep_alive_once(&shared).await;
        let wait = match alive {
            Ok(true) => {
                if shared.dirty.swap(false, Ordering::AcqRel)
                    && let Err(e) = republish(&shared).await
                {
                    shared.dirty.store(true, Ordering::Release);
                    tracing::warn!("etcd {}: re-publishing failed: {e}", shared.endpoint);
                }
                backoff = Duration::from_millis(100);
                period
            }
            Ok(false) => match regrant(&shared).await {
                Ok(()) => {
                    tracing::warn!(
                        "etcd {}: lease was lost; re-granted and re-published",
                        shared.endpoint
                    );
                    backoff = Duration::from_millis(100);
                    period
                }
                Err(e) => {
                    tracing::warn!("etcd {}: cannot re-grant the lease: {e}", shared.endpoint);
                    backoff
                }
            },
            Err(e) => {
                tracing::debug!("etcd {}: keep-alive failed: {e}", shared.endpoint);
                shared.dirty.store(true, Ordering::Release);
                backoff = (backoff * 2).min(Duration::from_secs(1));
                backoff
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shared.stop.notified() => return,
        }
        if shared.stopped.load(Ordering::Acquire) {
            return;
        }
    }
}

/// `Ok(true)`: the lease lives; `Ok(false)`: etcd answered that it does not; `Err`: no answer.
async fn keep_alive_once(shared: &Shared) -> Result<bool, String> {
    let mut client = shared.client.clone();
    let lease = shared.lease.load(Ordering::Acquire);
    let exchange = async {
        let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
        keeper.keep_alive().await?;
        let reply = stream.message().await?;
        Ok::<_, etcd_client::Error>(reply.is_some_and(|r| r.ttl() > 0))
    };
    let outcome: Result<(), String> =
        match tokio::time::timeout(shared.config.timeout, exchange).await {
            Ok(Ok(true)) => return Ok(true),
            Ok(Ok(false)) => Err("keep-alive answered TTL 0".to_owned()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("keep-alive timed out".to_owned()),
        };
    // Tell "etcd does not know this lease" (re-grant) from "etcd did not answer" (wait).
    let ask = client.lease_time_to_live(lease, None);
    match tokio::time::timeout(shared.config.timeout, ask).await {
        Ok(Ok(reply)) if reply.ttl() <= 0 => Ok(false),
        Ok(Err(e)) if e.to_string().contains("not found") => Ok(false),
        _ => outcome.map(|_| true),
    }
}

async fn regrant(shared: &Shared) -> Result<(), String> {
    let mut client = shared.client.clone();
    let ttl = shared.config.ttl.as_secs().max(1) as i64;
    let lease = client
        .lease_grant(ttl, None)
        .await
        .map_err(|e| e.to_string())?
        .id();
    shared.lease.store(lease, Ordering::Release);
    republish(shared).await
}

/// Watches the whole prefix and hands every change to the listeners. After an interruption
/// it says `Resync`, since changes may have been missed meanwhile.
async fn watch_loop(shared: Arc<Shared>) {
    let cluster = shared.config.cluster_id.clone();
    let prefix = keys::common_prefix(cluster.as_deref());
    let mut interrupted = false;
    let mut backoff = Duration::from_millis(100);
    while !shared.stopped.load(Ordering::Acquire) {
        let mut client = shared.client.clone();
        let watching = client
            .watch(prefix.clone(), Some(WatchOptions::new().with_prefix()))
            .await;
        if let Ok(mut stream) = watching {
            if interrupted {
                emit(&shared, MetadataEvent::Resync);
            }
            backoff = Duration::from_millis(100);
            loop {
                let message = tokio::select! {
                    m = stream.message() => m,
                    () = shared.stop.notified() => return,
                };
                let Ok(Some(reply)) = message else { break };
                if reply.canceled() {
                    break;
                }
                for event in reply.events() {
                    let Some(kv) = event.kv() else { continue };
                    let Ok(key) = kv.key_str() else { continue };
                    let deleted = event.event_type() == EventType::Delete;
                    if let Some(event) = shared.codec.event(key, kv.value(), deleted) {
                        emit(&shared, event);
                    }
                    if !deleted {
                        restore_if_overwritten(&shared, key, kv.value()).await;
                    }
                }
            }
        }
        interrupted = true;
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = shared.stop.notified() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// With a cluster secret: a key this node publishes, seen overwritten with a value that is
/// not a newer one of its own name (a replay of an older one, or a forgery), gets this node's
/// value back, so that nodes that start meanwhile do not take the replay. Another life of the
/// same name that started later is left alone.
async fn restore_if_overwritten(shared: &Shared, key: &str, value: &[u8]) {
    let Some(sealer) = shared.codec.sealer.as_ref() else {
        return;
    };
    let ours = || shared.published.lock().get(key).cloned();
    let Some(mine) = ours() else { return };
    if mine.as_bytes() == value || sealer.outranks(key, value, mine.as_bytes()) {
        return;
    }
    // The echo of an earlier put of this node's, overtaken since, is no overwrite.
    let mut client = shared.client.clone();
    let current = tokio::time::timeout(shared.config.timeout, client.get(key, None)).await;
    if let Ok(Ok(reply)) = &current
        && reply
            .kvs()
            .first()
            .is_some_and(|kv| kv.value() == mine.as_bytes())
    {
        return;
    }
    // Withdrawn meanwhile: not to be put back.
    if shared.stopped.load(Ordering::Acquire) || ours().as_ref() != Some(&mine) {
        return;
    }
    tracing::warn!(
        "etcd {}: {key} was overwritten with a value this node did not write last (a replay?); \
         putting its own back",
        shared.endpoint
    );
    if let Err(e) = put_leased(shared, key, &mine).await {
        shared.dirty.store(true, Ordering::Release);
        tracing::warn!("etcd {}: putting {key} back failed: {e}", shared.endpoint);
    }
}

fn emit(shared: &Shared, event: MetadataEvent) {
    let listeners: Vec<MetadataListener> = shared.listeners.lock().clone();
    for listener in listeners {
        listener(event.clone());
    }
}

impl KeyValue for EtcdKv {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn put(&self, key: String, value: String) -> Result<(), MetadataError> {
        self.publish(key, value);
        Ok(())
    }

    fn delete(&self, key: &str) -> Result<(), MetadataError> {
        self.withdraw(key)
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetadataError> {
        EtcdKv::get(self, key)
    }

    fn subscribe(&self, listener: MetadataListener) {
        self.shared.listeners.lock().push(listener);
    }

    fn shutdown(&self) {
        if self.shared.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        self.shared.stop.notify_waiters();
        self.shared.listeners.lock().clear();
        let keys: Vec<String> = self.shared.published.lock().keys().cloned().collect();
        for key in keys {
            if let Err(e) = self.withdraw(&key) {
                tracing::warn!("etcd: withdrawing {key}: {e}");
            }
        }
        let mut client = self.shared.client.clone();
        let lease = self.lease_id();
        let timeout = self.shared.config.timeout;
        self.block_on(async move {
            let _ = tokio::time::timeout(timeout, client.lease_revoke(lease)).await;
        });
    }
}

impl Drop for EtcdKv {
    fn drop(&mut self) {
        self.shutdown();
        if let Some(runtime) = self.runtime.take() {
            // Dropped from inside the runtime (a listener held the last reference): a
            // blocking shutdown is not allowed there.
            if tokio::runtime::Handle::try_current().is_ok() {
                runtime.shutdown_background();
            } else {
                runtime.shutdown_timeout(Duration::from_secs(1));
            }
        }
    }
}
