//! The client: [`HttpStore`], one short connection per request, sent again when the server
//! dropped it unanswered.

use std::io::{self, BufRead, BufReader, Write};
use std::sync::Arc;
use std::time::Duration;

use super::{escape, parse_response};
use crate::auth::ClusterSecret;
use crate::error::MetadataError;
use crate::keyed::{Codec, KeyValue, KeyedStore};
use crate::keys;
use crate::net::{Dial, dial};
use crate::seal;

/// The HTTP store (client side): Mooncake's HTTP protocol under [`KeyedStore`].
pub type HttpStore = KeyedStore<HttpKv>;

/// The key-value half of [`HttpStore`]: one short connection per request.
#[derive(Debug, Clone)]
pub struct HttpKv {
    url: String,
    host: String,
    port: u16,
    path: String,
    connect_timeout: Duration,
    timeout: Duration,
    /// Signs deletes (values are sealed by the codec, with the same sealer).
    sealer: Option<Arc<seal::Sealer>>,
}

impl HttpStore {
    /// A store at `http://host:port/path`. `https://` is not supported.
    pub fn new(url: &str) -> Result<Self, MetadataError> {
        let bad = || MetadataError::BadConnectionString(url.to_owned());
        if url.starts_with("https://") {
            return Err(MetadataError::Unsupported {
                kind: "https",
                conn: url.to_owned(),
            });
        }
        let rest = url.strip_prefix("http://").ok_or_else(bad)?;
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (host, port) = match crate::net::split_host_port(authority) {
            Some((host, port)) => (host.to_owned(), port),
            None if !authority.is_empty() && !authority.contains(':') => (authority.to_owned(), 80),
            None => return Err(bad()),
        };
        let kv = HttpKv {
            url: url.to_owned(),
            host,
            port,
            path: format!("/{path}"),
            connect_timeout: Duration::from_millis(1500),
            timeout: Duration::from_secs(3),
            sealer: None,
        };
        let codec = Codec {
            cluster_id: std::env::var(keys::CLUSTER_ID_ENV)
                .ok()
                .filter(|c| !c.is_empty()),
            sealer: None,
        };
        Ok(Self {
            kv,
            codec: Arc::new(codec),
        })
    }

    /// Scopes every key by `cluster_id` (`None`: unscoped).
    pub fn set_cluster_id(&mut self, cluster_id: Option<String>) {
        Arc::make_mut(&mut self.codec).cluster_id = cluster_id.filter(|c| !c.is_empty());
    }

    /// Seals what is written, checks what is read and signs deletes with `secret`, in an
    /// incarnation of its own: a store is one life of a node ([`seal::Sealer`]).
    pub fn set_secret(&mut self, secret: Option<ClusterSecret>) {
        let sealer = secret.map(|secret| Arc::new(seal::Sealer::new(secret)));
        Arc::make_mut(&mut self.codec).sealer = sealer.clone();
        self.kv.sealer = sealer;
    }
}

impl HttpKv {
    fn store_error(&self, message: impl std::fmt::Display) -> MetadataError {
        MetadataError::Store {
            endpoint: self.url.clone(),
            message: message.to_string(),
        }
    }

    /// One request; returns the status code and body. Every request here is idempotent
    /// (GET, PUT of a whole value, DELETE), so one the server dropped before answering — a
    /// server at its connection limit closes new connections, one restarting resets them —
    /// is sent again on a fresh connection, at most [`RESENDS`] times, waiting twice as long each.
    fn request(
        &self,
        method: &str,
        key: &str,
        body: Option<&str>,
        token: Option<&str>,
    ) -> Result<(u16, Vec<u8>), MetadataError> {
        let mut resends = 0;
        loop {
            match self.request_once(method, key, body, token) {
                Ok(reply) => return Ok(reply),
                Err(Attempt::Dropped(e)) if resends < RESENDS => {
                    tracing::debug!("{method} {key:?}: {e}; sending again");
                    std::thread::sleep(RESEND_PAUSE * (1 << resends));
                    resends += 1;
                }
                Err(Attempt::Dropped(e) | Attempt::Failed(e)) => return Err(e),
            }
        }
    }

    fn request_once(
        &self,
        method: &str,
        key: &str,
        body: Option<&str>,
        token: Option<&str>,
    ) -> Result<(u16, Vec<u8>), Attempt> {
        let authority = format!("{}:{}", self.host, self.port);
        let dialing = Dial {
            endpoint: &authority,
            connect_timeout: self.connect_timeout,
            auth: None,
        };
        let mut stream = dial(&dialing, self.timeout).map_err(|e| {
            Attempt::Failed(match e {
                crate::net::DialError::Connect(e) => self.store_error(format!("unreachable: {e}")),
                e => self.store_error(e),
            })
        })?;
        let body = body.unwrap_or("");
        let token = token
            .map(|token| format!("{}: {token}\r\n", seal::DELETE_HEADER))
            .unwrap_or_default();
        let request = format!(
            "{method} {}?key={} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n{token}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.path,
            escape(key),
            body.len()
        );
        let dropped = |e: io::Error| Attempt::Dropped(self.store_error(e));
        stream.write_all(request.as_bytes()).map_err(dropped)?;
        let mut reader = BufReader::new(stream);
        // Not one byte of an answer: the server dropped the request.
        match reader.fill_buf() {
            Ok([]) => return Err(dropped(io::ErrorKind::UnexpectedEof.into())),
            Ok(_) => {}
            Err(e) => return Err(dropped(e)),
        }
        parse_response(&mut reader).map_err(|e| Attempt::Failed(self.store_error(e)))
    }
}

/// How often a request the server dropped unanswered is sent again.
const RESENDS: u32 = 4;
/// The pause before the first resend (then doubling: 20, 40, 80, 160 ms).
const RESEND_PAUSE: Duration = Duration::from_millis(20);

/// Why one attempt at a request failed.
enum Attempt {
    /// The connection broke before any byte of an answer: worth sending again.
    Dropped(MetadataError),
    /// Anything else (unreachable, a broken answer): final.
    Failed(MetadataError),
}

impl KeyValue for HttpKv {
    fn kind(&self) -> &'static str {
        "http"
    }

    fn put(&self, key: String, value: String) -> Result<(), MetadataError> {
        match self.request("PUT", &key, Some(&value), None)? {
            (200, _) => Ok(()),
            (status, body) => Err(self.store_error(format!(
                "PUT {key:?} answered {status}: {}",
                String::from_utf8_lossy(&body)
            ))),
        }
    }

    fn delete(&self, key: &str) -> Result<(), MetadataError> {
        // The token names the value this node last wrote there; without one (this node wrote
        // none), the value found there.
        let token = match &self.sealer {
            None => None,
            Some(sealer) => match sealer.delete_token(key) {
                Some(token) => Some(token),
                None => match self.get(key)? {
                    None => return Ok(()),
                    Some(value) => {
                        Some(sealer.delete_token_for(key, &value).map_err(|source| {
                            MetadataError::Seal {
                                key: key.to_owned(),
                                source,
                            }
                        })?)
                    }
                },
            },
        };
        match self.request("DELETE", key, None, token.as_deref())? {
            (200 | 404, _) => {
                if let Some(sealer) = &self.sealer {
                    sealer.forget_sealed(key);
                }
                Ok(())
            }
            (status, body) => Err(self.store_error(format!(
                "DELETE {key:?} answered {status}: {}",
                String::from_utf8_lossy(&body)
            ))),
        }
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetadataError> {
        match self.request("GET", key, None, None)? {
            (200, body) => Ok(Some(body)),
            (404, _) => Ok(None),
            (status, _) => Err(self.store_error(format!("GET {key:?} answered {status}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse() {
        let store = HttpStore::new("http://127.0.0.1:8080/metadata").unwrap();
        assert_eq!(
            (
                store.kv.host.as_str(),
                store.kv.port,
                store.kv.path.as_str()
            ),
            ("127.0.0.1", 8080, "/metadata")
        );
        let store = HttpStore::new("http://meta").unwrap();
        assert_eq!((store.kv.port, store.kv.path.as_str()), (80, "/"));
        assert!(HttpStore::new("https://x:1/").is_err());
        assert!(HttpStore::new("http://:5/").is_err());
    }
}
