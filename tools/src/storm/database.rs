//! The storm's own database: created by the storm, never one it merely finds.
//!
//! A storm terminates every session of its database and writes test money into it, so it
//! runs only on a database it creates itself (a new database on a PostgreSQL or MySQL server,
//! a new SQLite file), and drops it again after a clean run. An existing database is refused
//! unless `--reuse-database` says so.

use std::path::PathBuf;

use payledger::store::Dialect;
use sqlx::AnyPool;

use crate::AnyError;

/// The longest database name the storm creates (PostgreSQL's identifier limit is 63 bytes).
const DATABASE_NAME_LEN_MAX: usize = 63;

/// Where the storm runs.
pub struct StormDatabase {
    pub url: String,
    pub dialect: Dialect,
    place: Place,
    /// True when this storm created it (and so may drop it).
    created: bool,
}

enum Place {
    Server { admin_url: String, name: String },
    SqliteFile(PathBuf),
}

impl StormDatabase {
    /// Creates the database `url` names; with `reuse`, an existing one is used as it is.
    ///
    /// # Errors
    /// When the database already exists (without `reuse`), the URL names no database or an
    /// unusual name, or the server cannot be reached.
    pub async fn create(url: &str, reuse: bool) -> Result<Self, AnyError> {
        let dialect =
            Dialect::from_url(url).ok_or("--database-url must start with postgres://, mysql:// or sqlite:")?;
        let (place, exists, url) = match dialect {
            Dialect::Sqlite => {
                let path = sqlite_path(url)?;
                let exists = path.exists();
                let url = format!("sqlite:{}", path.display());
                (Place::SqliteFile(path), exists, url)
            }
            Dialect::Postgres | Dialect::MySql => {
                let (server, name) = split_server_url(url)?;
                let url = format!("{server}/{name}");
                let admin_url = if dialect == Dialect::Postgres { format!("{server}/postgres") } else { server };
                let admin = AnyPool::connect(&admin_url).await?;
                let exists_sql = match dialect {
                    Dialect::Postgres => "SELECT COUNT(*) FROM pg_database WHERE datname = $1",
                    _ => "SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?",
                };
                let count: i64 = sqlx::query_scalar(exists_sql).bind(&name).fetch_one(&admin).await?;
                if count == 0 {
                    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await?;
                }
                admin.close().await;
                (Place::Server { admin_url, name }, count > 0, url)
            }
        };
        if exists && !reuse {
            return Err(format!(
                "refusing to run on {}: it already exists and this storm did not create it (a storm cuts every \
                 connection of its database and writes test money); name a new database, which the storm creates and \
                 drops, or pass --reuse-database",
                payledger::store::redacted(&url)
            )
            .into());
        }
        // The instances and the checks use exactly the database checked here: the URL is
        // rebuilt from what was parsed, with nothing a driver could read differently.
        Ok(Self { url, dialect, place, created: !exists })
    }

    /// The URL of this database on another node of the same cluster (a Galera node, whose
    /// databases every node shares): the same backend and database name on another server.
    ///
    /// # Errors
    /// When `url` is SQLite, another backend, or names another database.
    pub fn on_node(&self, url: &str) -> Result<String, AnyError> {
        let Place::Server { name, .. } = &self.place else {
            return Err("a SQLite storm takes one --database-url".into());
        };
        if Dialect::from_url(url) != Some(self.dialect) {
            return Err("every --database-url must be of the same backend".into());
        }
        let (server, node_name) = split_server_url(url)?;
        if &node_name != name {
            return Err(format!(
                "every --database-url must name the same database (one per node of a cluster): {name}, not {node_name}"
            )
            .into());
        }
        Ok(format!("{server}/{name}"))
    }

    /// Drops the database if this storm created it.
    ///
    /// # Errors
    /// When the server refuses the DROP or the file cannot be removed.
    pub async fn drop_if_created(self) -> Result<(), AnyError> {
        if !self.created {
            return Ok(());
        }
        match self.place {
            Place::Server { admin_url, name } => {
                let admin = AnyPool::connect(&admin_url).await?;
                let force = if self.dialect == Dialect::Postgres { " WITH (FORCE)" } else { "" };
                sqlx::query(&format!("DROP DATABASE {name}{force}")).execute(&admin).await?;
                admin.close().await;
            }
            Place::SqliteFile(path) => {
                for suffix in ["", "-wal", "-shm"] {
                    let mut file = path.clone().into_os_string();
                    file.push(suffix);
                    match std::fs::remove_file(&file) {
                        Err(error) if error.kind() != std::io::ErrorKind::NotFound => return Err(error.into()),
                        _ => {}
                    }
                }
            }
        }
        Ok(())
    }
}

/// The file of a `sqlite:` URL (`sqlite:path` or `sqlite://path`), taken literally: only
/// `[A-Za-z0-9._/-]`, no `..`, in a directory that exists. Anything else (options, escapes,
/// `file:` URIs, `:memory:`, white space) is refused, since a driver could open another file
/// than the one checked here; the path is rebuilt from the directory's canonical form.
fn sqlite_path(url: &str) -> Result<PathBuf, AnyError> {
    let refused = || -> AnyError {
        "--database-url must be sqlite:PATH with PATH of [A-Za-z0-9._/-], no '..', in an existing directory".into()
    };
    let rest = url.strip_prefix("sqlite:").unwrap_or(url);
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '/' | '-');
    if rest.is_empty() || !rest.chars().all(plain) || rest.split('/').any(|part| part == "..") {
        return Err(refused());
    }
    let path = PathBuf::from(rest);
    let file_name = path.file_name().ok_or_else(refused)?.to_owned();
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let directory = directory.canonicalize().map_err(|_| refused())?;
    Ok(directory.join(file_name))
}

/// The server part (scheme, user, host, port) and the database name of a PostgreSQL or MySQL
/// URL. Options (`?`) are refused (`?dbname=` would name another database than the path), and
/// so is a name that is not plain lower case (unquoted, a server folds or compares it
/// otherwise).
fn split_server_url(url: &str) -> Result<(String, String), AnyError> {
    // Only what a plain URL needs: no ?options (?dbname= names another database), no
    // #fragment or %-escape (parsed away, they leave the server's default database), no white
    // space.
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '/' | '@' | '-');
    if !url.chars().all(plain) {
        return Err("--database-url must be scheme://user@host:port/name of [A-Za-z0-9._:/@-] for the storm \
                    (no ?options, #fragment, %-escapes or password characters beyond those)"
            .into());
    }
    let authority_start = url.find("://").map_or(0, |at| at + 3);
    let (server, name) = match url[authority_start..].find('/') {
        Some(slash) => (&url[..authority_start + slash], &url[authority_start + slash + 1..]),
        None => (url, ""),
    };
    let plain = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
    if name.is_empty() || name.len() > DATABASE_NAME_LEN_MAX || !name.chars().all(plain) {
        return Err(
            "--database-url must name a database of 1-63 characters of [a-z0-9_] for the storm to create".into()
        );
    }
    Ok((server.to_owned(), name.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_url_splits_into_its_server_and_the_database_name() {
        let (server, name) = split_server_url("postgres://u@h:5432/storm_1").unwrap();
        assert_eq!((server.as_str(), name.as_str()), ("postgres://u@h:5432", "storm_1"));
        let (server, name) = split_server_url("mysql://root@h:3306/storm").unwrap();
        assert_eq!((server.as_str(), name.as_str()), ("mysql://root@h:3306", "storm"));
    }

    #[test]
    fn a_url_whose_database_a_driver_could_read_otherwise_is_refused() {
        for url in [
            "postgres://u@h:5432",
            "postgres://u@h:5432/",
            "postgres://u@h/a;drop",
            "mysql://h/a-b",
            "postgres://u@h/storm?dbname=victim",
            "postgres://u@h/Storm_Mixed",
            "postgres://victim@h:5432#/storm_new",
            "postgres://u@h/st%6frm",
            "postgres://u@h/storm\n",
        ] {
            assert!(split_server_url(url).is_err(), "{url}");
        }
    }

    #[test]
    fn sqlite_urls_name_their_file_literally_or_are_refused() {
        let directory = tempfile::tempdir().unwrap();
        let canonical = directory.path().canonicalize().unwrap();
        let url = format!("sqlite:{}/a.db", directory.path().display());
        assert_eq!(sqlite_path(&url).unwrap(), canonical.join("a.db"));
        let base = directory.path().display();
        for url in [
            format!("sqlite:{base}/a.db?mode=rwc"),
            format!("sqlite:{base}/vic%74im.db"),
            format!("sqlite:sqlite:{base}/a.db"),
            format!("sqlite:file:{base}/a.db"),
            format!("sqlite:{base}/missing/../a.db"),
            format!("sqlite:{base}/missing/a.db"),
            format!("sqlite:{base}/a\t.db"),
            "sqlite::memory:".to_owned(),
            "sqlite:".to_owned(),
        ] {
            assert!(sqlite_path(&url).is_err(), "{url}");
        }
    }
}
