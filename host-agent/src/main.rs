fn main() -> anyhow::Result<()> {
    anyhow::bail!("gpufeed-host is not built yet")
}
