# frozen_string_literal: true

require 'minitest/autorun'
require 'fileutils'
require_relative 'fake_vmhostd'
require_relative '../lib/puppet_x/vmhost/client'

# The client's protocol handling against a fake daemon: results, daemon errors and every
# transport failure the provider has to turn into a clear Puppet error.
class TestClient < Minitest::Test
  def setup
    @fake = nil
  end

  def teardown
    @fake&.close
  end

  def serve(&)
    @fake = FakeVmhostd.new(&)
  end

  def client(**opts)
    PuppetX::Vmhost::Client.new(@fake.path, **opts)
  end

  def test_result_and_request_shape
    serve { |_req| { 'result' => { 'version' => '0.1.0', 'api_version' => 1 } } }
    assert_equal({ 'version' => '0.1.0', 'api_version' => 1 }, client.call('host.info'))
    req = @fake.request_list.first
    assert_equal '2.0', req['jsonrpc']
    assert_equal 'host.info', req['method']
    assert_equal({}, req['params'])
    assert_kind_of String, req['id']
  end

  def test_params_are_sent_as_an_object
    serve { |req| { 'result' => req['params'] } }
    assert_equal({ 'name' => 'web1' }, client.call('vm.get', { 'name' => 'web1' }))
  end

  def test_daemon_error_carries_code_kind_field_and_details
    serve do |_req|
      { 'error' => { 'code' => 3002, 'message' => 'cpu 9 exceeds the 3 CPUs available',
                     'data' => { 'kind' => 'capacity_exceeded', 'field' => 'spec.cpu',
                                 'details' => { 'resource' => 'cpu', 'requested' => 9, 'available' => 3 } } } }
    end
    err = assert_raises(PuppetX::Vmhost::DaemonError) { client.call('vm.apply', { 'spec' => {} }) }
    assert_equal 3002, err.code
    assert_equal 'capacity_exceeded', err.kind
    assert_equal 'spec.cpu', err.field
    assert_equal 'cpu 9 exceeds the 3 CPUs available', err.daemon_message
    assert_equal({ 'resource' => 'cpu', 'requested' => 9, 'available' => 3 }, err.details)
    assert_equal 'vmhostd refused vm.apply: error 3002 (capacity_exceeded) on field spec.cpu: ' \
                 'cpu 9 exceeds the 3 CPUs available; details: {"resource":"cpu","requested":9,"available":3}',
                 err.message
  end

  def test_error_without_data
    serve { |_req| { 'error' => { 'code' => -32_601, 'message' => 'Method not found' } } }
    err = assert_raises(PuppetX::Vmhost::DaemonError) { client.call('vm.frob') }
    assert_equal(-32_601, err.code)
    assert_nil err.field
    assert_equal 'vmhostd refused vm.frob: error -32601: Method not found', err.message
  end

  def test_error_with_null_id_is_the_daemons_answer
    line = JSON.generate({ 'jsonrpc' => '2.0', 'id' => nil,
                           'error' => { 'code' => 1001, 'message' => 'uid 65534 may not use this socket',
                                        'data' => { 'kind' => 'unauthorized', 'field' => nil, 'details' => nil } } })
    serve { |_req| "#{line}\n" }
    err = assert_raises(PuppetX::Vmhost::DaemonError) { client.call('vm.list') }
    assert_equal 1001, err.code
    assert_match(/error 1001 \(unauthorized\): uid 65534/, err.message)
  end

  def test_no_socket
    dir = Dir.mktmpdir
    c = PuppetX::Vmhost::Client.new(File.join(dir, 'nosuch.sock'))
    err = assert_raises(PuppetX::Vmhost::ConnectionError) { c.call('host.info') }
    assert_match(%r{cannot connect to vmhostd at .*/nosuch\.sock: No such file or directory}, err.message)
  ensure
    FileUtils.remove_entry(dir)
  end

  def test_socket_path_that_is_not_a_socket
    dir = Dir.mktmpdir
    path = File.join(dir, 'plain')
    File.write(path, '')
    err = assert_raises(PuppetX::Vmhost::ConnectionError) { PuppetX::Vmhost::Client.new(path).call('host.info') }
    assert_match(/cannot connect/, err.message)
  ensure
    FileUtils.remove_entry(dir)
  end

  def test_garbage_reply
    serve { |_req| "this is not json\n" }
    err = assert_raises(PuppetX::Vmhost::ProtocolError) { client.call('vm.list') }
    assert_match(/vm\.list: reply from vmhostd is not JSON/, err.message)
  end

  def test_reply_that_is_not_an_object
    serve { |_req| "[1,2]\n" }
    err = assert_raises(PuppetX::Vmhost::ProtocolError) { client.call('vm.list') }
    assert_match(/not a JSON object/, err.message)
  end

  def test_invalid_utf8_reply
    serve { |_req| "{\"a\":\"\xff\"}\n".b }
    assert_raises(PuppetX::Vmhost::ProtocolError) { client.call('vm.list') }
  end

  def test_oversize_reply_line
    serve { |_req| 'x' * 300_000 }
    err = assert_raises(PuppetX::Vmhost::ProtocolError) { client(max_reply_bytes: 100_000).call('vm.list') }
    assert_match(/longer than 100000 bytes/, err.message)
  end

  def test_oversize_reply_is_refused_before_the_daemon_stops_sending
    # A reply without an end is refused once it passes the limit, not read forever.
    serve { |_req| "{\"result\":\"#{'y' * 50_000}" }
    assert_raises(PuppetX::Vmhost::ProtocolError) { client(max_reply_bytes: 20_000).call('vm.list') }
  end

  def test_timeout
    serve { |_req| :hang }
    t0 = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    err = assert_raises(PuppetX::Vmhost::TimeoutError) { client(timeout: 0.5).call('vm.apply', {}) }
    elapsed = Process.clock_gettime(Process::CLOCK_MONOTONIC) - t0
    assert_match(/vm\.apply: no reply from vmhostd/, err.message)
    assert_operator elapsed, :>=, 0.4
    assert_operator elapsed, :<, 3
  end

  def test_per_call_timeout_overrides_the_default
    serve { |_req| :hang }
    t0 = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    assert_raises(PuppetX::Vmhost::TimeoutError) { client(timeout: 60).call('vm.get', {}, timeout: 0.3) }
    assert_operator Process.clock_gettime(Process::CLOCK_MONOTONIC) - t0, :<, 3
  end

  def test_id_mismatch
    serve { |_req| { 'id' => 'someone-else', 'result' => [] } }
    err = assert_raises(PuppetX::Vmhost::ProtocolError) { client.call('vm.list') }
    assert_match(/reply id "someone-else" does not match request id "puppet-/, err.message)
  end

  def test_closed_without_reply
    serve { |_req| :close }
    err = assert_raises(PuppetX::Vmhost::ConnectionError) { client.call('vm.list') }
    assert_match(/closed the connection without a reply/, err.message)
  end

  def test_reply_without_result_or_error
    serve { |_req| { 'foo' => 1 } }
    assert_raises(PuppetX::Vmhost::ProtocolError) { client.call('vm.list') }
  end

  def test_blank_lines_before_the_reply_are_skipped
    serve { |req| "\n\r\n#{JSON.generate({ 'jsonrpc' => '2.0', 'id' => req['id'], 'result' => 7 })}\n" }
    assert_equal 7, client.call('vm.list')
  end

  def test_reply_in_small_pieces_is_reassembled
    # The reply is bigger than one read chunk.
    big = 'z' * 200_000
    serve { |_req| { 'result' => big } }
    assert_equal big, client.call('vm.list')
  end

  def test_socket_path_resolution
    old = ENV.fetch('VMHOST_SOCKET', nil)
    ENV['VMHOST_SOCKET'] = '/tmp/from-env.sock'
    assert_equal '/tmp/explicit.sock', PuppetX::Vmhost.socket_path('/tmp/explicit.sock')
    assert_equal '/tmp/from-env.sock', PuppetX::Vmhost.socket_path(nil)
    ENV['VMHOST_SOCKET'] = ''
    assert_equal '/run/vmhost/vmhostd.sock', PuppetX::Vmhost.socket_path(nil)
    ENV.delete('VMHOST_SOCKET')
    assert_equal '/run/vmhost/vmhostd.sock', PuppetX::Vmhost.socket_path
  ensure
    old.nil? ? ENV.delete('VMHOST_SOCKET') : ENV['VMHOST_SOCKET'] = old
  end
end
