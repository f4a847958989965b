//! Route traces (`src/routes.rs`, `--record-routes`): a trace round-trips, malformed ones
//! are refused.

use k3_protocol::routes::*;

fn two() -> RouteTrace {
    let mut t = RouteTrace::new("fp".into(), 3, vec![1, 2], 8, 2);
    t.push(0, 1, &[7, 3]).unwrap();
    t.push(0, 2, &[0, 5]).unwrap();
    t
}

/// Round trip: what is written reads back, record for record. Catches a field written
/// in the wrong width or order.
#[test]
fn a_trace_round_trips() {
    let t = two();
    let b = t.to_bytes();
    assert_eq!(
        b.len(),
        16 + serde_json::to_vec(&t.header).unwrap().len() + 2 * 10
    );
    let r = RouteTrace::parse(&b, "t").unwrap();
    assert_eq!(r, t);
    let routes: Vec<Route> = r.routes().collect();
    assert_eq!(
        routes[0],
        Route {
            position: 0,
            layer: 1,
            ids: vec![7, 3]
        }
    );
    assert_eq!(routes[1].ids, vec![0, 5]);
}

/// Each malformation is refused with its own reason, never read as routes: a truncated
/// body, a record count the body does not hold, an id past `experts`, a layer that is
/// not MoE, a foreign file, a wrong top-k pushed.
#[test]
fn malformed_traces_are_refused() {
    let b = two().to_bytes();
    assert!(matches!(
        RouteTrace::parse(&b[..b.len() - 1], "t"),
        Err(RoutesError::Malformed { .. })
    ));
    assert!(matches!(
        RouteTrace::parse(b"K3TRACE\0xxxxxxxx", "t"),
        Err(RoutesError::Magic(_))
    ));
    let mut t = RouteTrace::new("fp".into(), 3, vec![1], 8, 2);
    t.push(0, 1, &[8, 1]).unwrap();
    let e = RouteTrace::parse(&t.to_bytes(), "t")
        .unwrap_err()
        .to_string();
    assert!(e.contains("expert 8 of 8"), "{e}");
    let mut t = RouteTrace::new("fp".into(), 3, vec![1], 8, 2);
    t.push(0, 2, &[0, 1]).unwrap();
    let e = RouteTrace::parse(&t.to_bytes(), "t")
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer 2 is not a MoE layer"), "{e}");
    assert!(matches!(
        t.push(1, 1, &[1]),
        Err(RoutesError::TopK { got: 1, want: 2 })
    ));
    assert!(matches!(
        t.push(1, 1, &[1, 70_000]),
        Err(RoutesError::Wide { .. })
    ));
    assert_eq!(t.header.records, 1, "a refused route is not counted");
    assert!(
        RouteTrace::parse(&t.to_bytes(), "t").is_err(),
        "layer 2 stays refused"
    );
}
