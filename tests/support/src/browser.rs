//! Headless Chromium driven through chromedriver (WebDriver, over plain HTTP on loopback), for the
//! operator console's browser tests (feature `browser`).
//!
//! [`Browser::start`] finds `chromedriver` (on PATH, /usr/bin/chromedriver or
//! /usr/lib/chromium/chromedriver) and Chromium, starts the driver on a free port in a process
//! group of its own (so that dropping the [`Browser`] ends the driver and every Chromium process it
//! started, even after a panic), and opens a session: `--headless=new --no-sandbox
//! --disable-dev-shm-usage --window-size=1400,1000`. Without Chromium or chromedriver it says why
//! and returns None, so a developer without them sees the tests skipped; with `CI` set it panics
//! instead (`scripts/ci-deps.sh` installs both, and CI must run these tests).

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

/// The browser window's size (and that of every screenshot but the full-page ones).
pub const WINDOW: (u32, u32) = (1400, 1000);

/// chromedriver: on PATH, else where Debian's chromium-driver puts it.
pub fn chromedriver_path() -> Option<PathBuf> {
    on_path("chromedriver").or_else(|| {
        ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
    })
}

/// Chromium (or Chrome): on PATH, else where Debian's chromium puts it.
pub fn chromium_path() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"].into_iter().find_map(on_path).or_else(|| {
        ["/usr/bin/chromium", "/usr/lib/chromium/chromium"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
    })
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|dir| dir.join(name)).find(|p| p.is_file())
}

/// Whether this is a CI run (`CI` set to anything but empty, `0` or `false`): there a missing
/// browser fails the test instead of skipping it.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// A WebDriver session in headless Chromium, and the chromedriver serving it.
pub struct Browser {
    pub client: Client,
    driver: Child,
}

impl Browser {
    /// Starts chromedriver and a session; None (having printed why) when Chromium or chromedriver
    /// is not installed and this is not CI. Panics when they are installed but do not start.
    pub async fn start() -> Option<Browser> {
        let (driver, chromium) = match (chromedriver_path(), chromium_path()) {
            (Some(driver), Some(chromium)) => (driver, chromium),
            (driver, chromium) => {
                let missing: Vec<&str> =
                    [(driver.is_none(), "chromedriver"), (chromium.is_none(), "chromium")]
                        .into_iter()
                        .filter_map(|(gone, name)| gone.then_some(name))
                        .collect();
                let why = format!(
                    "{} not installed (Debian: apt-get install chromium chromium-driver; `make deps` does it)",
                    missing.join(" and ")
                );
                assert!(!in_ci(), "the console's browser tests must run in CI, but {why}");
                eprintln!("SKIPPED: the console's browser test needs headless Chromium: {why}");
                return None;
            }
        };
        let port = crate::port::free();
        let mut driver = Command::new(&driver)
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // A group of its own: Drop ends the driver and the browsers it started together.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", driver.display()));
        let url = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(5)).build().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = driver.try_wait() {
                panic!("chromedriver exited at start-up ({status})");
            }
            let ready = match http.get(format!("{url}/status")).send().await {
                Ok(r) => r.text().await.ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()),
                Err(_) => None,
            };
            if ready.is_some_and(|v| v["value"]["ready"] == true) {
                break;
            }
            if Instant::now() > deadline {
                kill_group(&mut driver);
                panic!("chromedriver did not answer {url}/status within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let capabilities = json!({
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium.display().to_string(),
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-dev-shm-usage",
                    format!("--window-size={},{}", WINDOW.0, WINDOW.1),
                    "--lang=en-US",
                    "--hide-scrollbars",
                    "--force-device-scale-factor=1",
                ],
            },
        });
        let Value::Object(capabilities) = capabilities else { unreachable!() };
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = match ClientBuilder::new(connector).capabilities(capabilities).connect(&url).await {
            Ok(client) => client,
            Err(e) => {
                kill_group(&mut driver);
                panic!("opening a WebDriver session in {}: {e}", chromium.display());
            }
        };
        Some(Browser { client, driver })
    }

    /// Ends the session (Chromium quits), then the driver.
    pub async fn close(mut self) {
        let client = self.client.clone();
        let _ = tokio::time::timeout(Duration::from_secs(10), client.close()).await;
        kill_group(&mut self.driver);
    }

    /// Opens `url` and waits for its page to load.
    pub async fn goto(&self, url: &str) {
        self.client.goto(url).await.unwrap_or_else(|e| panic!("opening {url}: {e}"));
    }

    /// The path of the page shown (`/events/billing/evt_1`).
    pub async fn path(&self) -> String {
        self.client.current_url().await.expect("the current URL").path().to_owned()
    }

    /// The elements matching `css` (none: empty).
    pub async fn all(&self, css: &str) -> Vec<fantoccini::elements::Element> {
        self.client.find_all(Locator::Css(css)).await.unwrap_or_else(|e| panic!("finding {css}: {e}"))
    }

    /// Whether an element matches `css`.
    pub async fn exists(&self, css: &str) -> bool {
        !self.all(css).await.is_empty()
    }

    /// The element matching `css`; panics (with the page's text) when there is none.
    pub async fn find(&self, css: &str) -> fantoccini::elements::Element {
        match self.client.find(Locator::Css(css)).await {
            Ok(element) => element,
            Err(e) => panic!(
                "no element {css} on {} ({e}); the page says:\n{}",
                self.path().await,
                self.page_text().await
            ),
        }
    }

    /// The rendered text of the element matching `css`.
    pub async fn text(&self, css: &str) -> String {
        self.find(css).await.text().await.unwrap_or_else(|e| panic!("the text of {css}: {e}"))
    }

    /// The rendered text of the whole page.
    pub async fn page_text(&self) -> String {
        match self.client.find(Locator::Css("body")).await {
            Ok(body) => body.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Clicks the element matching `css` (a link, a submit button). The page it opens may still be
    /// loading when this returns (a form's POST and its redirect): [`Browser::wait_for_path`].
    pub async fn click(&self, css: &str) {
        self.find(css).await.click().await.unwrap_or_else(|e| panic!("clicking {css}: {e}"));
    }

    /// Waits until the page shown is at `path`, up to `timeout`: after a click that navigates.
    pub async fn wait_for_path(&self, path: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let now = self.path().await;
            if now == path {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "still on {now}, not {path}, after {timeout:?}; the page says:\n{}",
                    self.page_text().await
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until an element matches `css`, up to `timeout`.
    pub async fn wait_for(&self, css: &str, timeout: Duration) -> fantoccini::elements::Element {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(element) = self.client.find(Locator::Css(css)).await {
                return element;
            }
            if Instant::now() > deadline {
                panic!(
                    "no element {css} on {} within {timeout:?}; the page says:\n{}",
                    self.path().await,
                    self.page_text().await
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Runs `script` in the page and returns its value.
    pub async fn execute(&self, script: &str) -> Value {
        self.client.execute(script, Vec::new()).await.unwrap_or_else(|e| panic!("running {script}: {e}"))
    }

    /// Signs in on the sign-in form of the console at `base` (typing, then the submit button) and
    /// waits to leave the form.
    pub async fn sign_in(&self, base: &str, user: &str, password: &str) {
        self.goto(&format!("{base}/login")).await;
        self.find("input[name=user]").await.send_keys(user).await.expect("typing the user");
        self.find("input[name=password]").await.send_keys(password).await.expect("typing the password");
        self.click("form[action='/login'] button[type=submit]").await;
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.path().await == "/login" {
            assert!(Instant::now() < deadline, "still on the sign-in form:\n{}", self.page_text().await);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The value of the cookie `name` (HttpOnly ones too: WebDriver sees them).
    pub async fn cookie(&self, name: &str) -> String {
        let cookie =
            self.client.get_named_cookie(name).await.unwrap_or_else(|e| panic!("the cookie {name}: {e}"));
        cookie.value().to_owned()
    }

    /// Saves a PNG of the whole page (the window made as tall as the page, up to 4000 px) as
    /// `dir/name`.
    pub async fn screenshot(&self, dir: &Path, name: &str) {
        let height = self
            .execute(
                "return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight];",
            )
            .await;
        let page = height[0].as_u64().unwrap_or(u64::from(WINDOW.1));
        let chrome = height[1].as_u64().unwrap_or(0);
        let tall = (page + chrome).clamp(u64::from(WINDOW.1), 4000) as u32;
        self.client.set_window_size(WINDOW.0, tall).await.expect("resizing the window");
        let png = self.client.screenshot().await.expect("a screenshot");
        self.client.set_window_size(WINDOW.0, WINDOW.1).await.expect("resizing the window back");
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let path = dir.join(name);
        std::fs::write(&path, png).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        eprintln!("screenshot: {}", path.display());
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        kill_group(&mut self.driver);
    }
}

/// SIGKILL to the driver's process group (the driver and every Chromium process it started), then
/// reaps the driver.
fn kill_group(driver: &mut Child) {
    // The group outlives the driver while any of its browsers does: kill it either way.
    crate::process::kill(-(driver.id() as i32), libc::SIGKILL);
    let _ = driver.wait();
}
