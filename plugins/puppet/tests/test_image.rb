# frozen_string_literal: true

require_relative 'puppet_run'

require 'puppet/type/vmhost_image'
require 'puppet/provider/vmhost_image/vmhostd'
require 'puppet/type/vmhost_vm'
require 'puppet/provider/vmhost_vm/vmhostd'

SHA = 'ab' * 32
OTHER = 'cd' * 32

# A tiny image store answering image.list / image.import / image.delete as vmhostd does
# (docs/images.md), over the test's @images (name => view, the file's real sha256 in
# '_content') and @uploads (source => sha256 of its bytes).
module FakeImageLogic
  def handle(req)
    p = req['params'] || {}
    case req['method']
    when 'image.list' then { 'result' => @images.values.map { |i| view(i) } }
    when 'image.import' then import(p)
    when 'image.delete' then delete(p['name'])
    else { 'error' => { 'code' => -32_601, 'message' => 'Method not found' } }
    end
  end

  def view(image)
    image.reject { |k, _| k.start_with?('_') }
  end

  def put(name, content, sha256: nil, source: nil, used_by: [])
    @images[name] = { 'name' => name, 'bytes' => 512, 'format' => 'raw', 'virtual_size' => 512,
                      'sha256' => sha256, 'source' => source, 'imported_at' => sha256 && '2026-12-03T10:00:00Z',
                      'used_by' => used_by, '_content' => content }
  end

  def err(code, message, field, kind, details = nil)
    { 'error' => { 'code' => code, 'message' => message,
                   'data' => { 'kind' => kind, 'field' => field, 'details' => details } } }
  end

  def mismatch(want, found)
    err(2003, "upload.raw has sha256 #{found}, not #{want}", 'sha256', 'checksum_mismatch',
        { 'expected' => want, 'found' => found, 'bytes' => 512 })
  end

  def import(params)
    name = params['name']
    want = params['sha256'].downcase
    image = @images[name]
    return import_existing(image, want, params['source']) if image
    return err(4040, "no image \"#{name}\" in /images: give a source", 'source', 'not_found') if params['source'].nil?
    return mismatch(want, @uploads[params['source']]) if @uploads[params['source']] != want

    put(name, want, sha256: want, source: params['source'])
    { 'result' => { 'changed' => true, 'image' => view(@images[name]) } }
  end

  def import_existing(image, want, source)
    recorded = image['sha256'] || image['_content']
    if recorded != want
      return mismatch(want, recorded) if image['sha256'].nil? && source.nil?

      return err(4093, "image \"#{image['name']}\" is there with sha256 #{recorded}, not #{want}: delete it first",
                 'name', 'image_exists', { 'sha256' => recorded })
    end
    changed = image['sha256'].nil?
    image['sha256'] = want
    { 'result' => { 'changed' => changed, 'image' => view(image) } }
  end

  def delete(name)
    image = @images[name]
    if image && !image['used_by'].empty?
      return err(4092, "image \"#{name}\" is the base of VMs #{image['used_by']}", 'name', 'image_in_use',
                 { 'vms' => image['used_by'] })
    end
    { 'result' => { 'changed' => !@images.delete(name).nil?, 'name' => name } }
  end
end

# vmhost_image in a real (in-process) Puppet catalog run against a fake daemon.
class TestImage < Minitest::Test
  include PuppetRun
  include FakeImageLogic

  def setup
    @images = {}
    @uploads = { 'upload.raw' => SHA }
    super
  end

  def apply_image(noop: false, **attrs)
    apply_resource(:vmhost_image, noop: noop, **attrs)
  end

  def base(**extra)
    { name: 'base.raw', sha256: SHA, source: 'upload.raw' }.merge(extra)
  end

  def test_present_imports_once_then_changes_nothing
    status = apply_image(**base(sha256: SHA.upcase))
    assert status.changed
    refute status.failed
    reqs = @fake.request_list
    assert_equal(%w[image.list image.import], reqs.map { |r| r['method'] })
    assert_equal({ 'name' => 'base.raw', 'sha256' => SHA, 'source' => 'upload.raw' }, reqs[1]['params'])
    assert_equal SHA, @images['base.raw']['sha256']
    assert_includes logs_text, 'created'
    refute apply_image(**base).changed
    assert_equal %w[image.list], @fake.methods_called
    # The source is never compared.
    refute apply_image(**base(source: 'https://example.org/elsewhere.raw')).changed
    assert_equal %w[image.list], @fake.methods_called
  end

  def test_timeout_s_is_passed_on
    apply_image(**base(timeout_s: '90'))
    assert_equal 90, @fake.request_list[1]['params']['timeout_s']
  end

  def test_noop_sends_nothing_but_reports
    status = apply_image(noop: true, **base)
    refute status.changed
    assert_equal 1, status.events.size
    assert_equal 'noop', status.events.first.status
    assert_equal %w[image.list], @fake.methods_called
    assert_empty @images
  end

  def test_a_wrong_sha256_fails_with_the_daemons_checksum_mismatch
    status = apply_image(**base(sha256: OTHER))
    assert status.failed
    line = @logs.map(&:to_s).grep(/vmhostd refused/).first.to_s
    assert_includes line, 'vmhostd refused image.import: error 2003 (checksum_mismatch) on field sha256: '
    assert_includes line, "\"found\":\"#{SHA}\""
    assert_empty @images
  end

  def test_another_sha256_is_never_replaced
    put('base.raw', SHA, sha256: SHA, source: 'upload.raw')
    status = apply_image(**base(sha256: OTHER))
    assert status.failed
    line = @logs.map(&:to_s).grep(/vmhostd refused/).first.to_s
    assert_includes line, 'error 4093 (image_exists) on field name: '
    assert_includes line, SHA
    assert_includes line, OTHER
    assert_includes line, 'an image is never replaced (VMs hold overlays over it): delete it first (ensure => absent)'
    assert_equal SHA, @images['base.raw']['sha256']
    # In noop mode the difference is reported, nothing sent.
    @fake.request_list
    status = apply_image(noop: true, **base(sha256: OTHER))
    assert_equal 'noop', status.events.first.status
    assert_equal %w[image.list], @fake.methods_called
  end

  def test_a_hand_placed_file_is_recorded_where_it_is
    put('hand.raw', SHA)
    status = apply_image(name: 'hand.raw', sha256: SHA)
    assert status.changed
    refute status.failed
    reqs = @fake.request_list
    assert_equal(%w[image.list image.import], reqs.map { |r| r['method'] })
    assert_equal({ 'name' => 'hand.raw', 'sha256' => SHA }, reqs[1]['params'])
    assert_includes logs_text, "recorded with sha256 #{SHA} (it was there without a sha256 record)"
    assert_equal SHA, @images['hand.raw']['sha256']
    refute apply_image(name: 'hand.raw', sha256: SHA).changed
  end

  def test_ensure_present_needs_a_sha256
    status = apply_image(name: 'base.raw', source: 'upload.raw')
    assert status.failed
    assert_includes logs_text, 'sha256 is required to import an image'
    assert_equal %w[image.list], @fake.methods_called
  end

  def test_absent_deletes_then_has_nothing_to_do
    put('base.raw', SHA, sha256: SHA)
    assert apply_image(name: 'base.raw', ensure: 'absent').changed
    assert_equal %w[image.list image.delete], @fake.methods_called
    assert_empty @images
    refute apply_image(name: 'base.raw', ensure: 'absent').changed
    assert_equal %w[image.list], @fake.methods_called
  end

  def test_absent_in_use_fails_naming_the_vms
    put('base.raw', SHA, sha256: SHA, used_by: %w[web db])
    status = apply_image(name: 'base.raw', ensure: 'absent')
    assert status.failed
    line = @logs.map(&:to_s).grep(/vmhostd refused/).first.to_s
    assert_includes line, 'error 4092 (image_in_use) on field name: '
    assert_includes line, 'the image is the base of VMs web, db: destroy them'
    assert @images.key?('base.raw')
  end

  def test_unreachable_socket_fails_the_resource
    status = apply_image(**base(socket: File.join(PUPPET_DIR, 'nosuch.sock')))
    assert status.failed
    assert_includes logs_text, 'cannot connect to vmhostd at'
  end

  def test_shape_validation_in_the_type
    type = Puppet::Type.type(:vmhost_image)
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', sha256: 'ab' * 31) }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', sha256: 'zz' * 32) }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', sha256: 42) }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', timeout_s: 'soon') }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', source: '') }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', socket: 'relative.sock') }
    assert_raises(Puppet::ResourceError) { type.new(name: 'x', ensure: 'latest') }
    assert_equal SHA, type.new(name: 'x', sha256: SHA.upcase)[:sha256]
    # Rules are the daemon's: a name it would refuse passes the type.
    assert type.new(name: '../not a name', sha256: SHA)
  end

  def test_instances_show_recorded_and_hand_placed_images
    put('base.raw', SHA, sha256: SHA, source: 'upload.raw')
    put('hand.raw', OTHER)
    found = with_default_socket { Puppet::Type.type(:vmhost_image).provider(:vmhostd).instances }
    assert_equal(%w[base.raw hand.raw], found.map(&:name))
    assert_equal [SHA, nil], found.map(&:sha256)
    assert(found.all?(&:exists?))
  end

  def test_a_vm_booting_from_an_image_autorequires_it
    catalog = Puppet::Resource::Catalog.new
    image = Puppet::Type.type(:vmhost_image).new(base(name: 'base.qcow2'))
    vm = Puppet::Type.type(:vmhost_vm).new(name: 'web', boot: { 'image' => 'base.qcow2', 'disk_gib' => 2 })
    other = Puppet::Type.type(:vmhost_vm).new(name: 'k', boot: { 'kernel' => '/srv/vmlinuz' })
    [image, vm, other].each { |r| catalog.add_resource(r) }
    assert_equal([image.ref], vm.autorequire.map { |edge| edge.source.ref })
    assert_empty other.autorequire
  end
end
