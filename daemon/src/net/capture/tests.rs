use super::*;

#[test]
fn cookies_round_trip_and_fit_the_kernel() {
    let tap = "vmh0123abcdn15";
    let c = cookie(tap);
    assert_eq!(c, b"vmhc0123abcdn15");
    assert!(c.len() <= 16);
    assert_eq!(parse_cookie(&c).as_deref(), Some(tap));
}
